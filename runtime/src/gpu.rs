//! The CUDA device: context, stream and the checks that turn a missing driver into a typed
//! error instead of cudarc's panic.

use std::sync::Arc;

pub use cudarc::driver::CudaContext;
use cudarc::driver::sys::{CUdevice_attribute, CUresult};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use moeforge_compiler::plan::{DeviceFacts, Target};
use thiserror::Error;

use crate::jit::{CompiledKernels, CompiledModule};
use crate::toolkit::{self, ToolkitError};

/// A layer's kernels loaded on one device: a module per entry point, or one module for
/// the whole unit.
#[derive(Clone, Debug)]
pub struct LoadedKernels {
    /// Each module with the entry points it holds (empty: every one).
    modules: Vec<(Vec<String>, Arc<CudaModule>)>,
}

impl LoadedKernels {
    /// A module of the whole unit.
    pub fn whole(module: Arc<CudaModule>) -> Self {
        LoadedKernels {
            modules: vec![(Vec::new(), module)],
        }
    }

    /// How many modules the driver loaded.
    pub fn module_count(&self) -> usize {
        self.modules.len()
    }

    /// Entry point `name`, from the module that holds it, else from a module of the whole
    /// unit.
    pub fn load_function(&self, name: &str) -> Result<CudaFunction, DriverError> {
        let holds = |kernels: &Vec<String>| kernels.iter().any(|k| k == name);
        let module = self
            .modules
            .iter()
            .find(|(kernels, _)| holds(kernels))
            .or_else(|| self.modules.iter().find(|(kernels, _)| kernels.is_empty()))
            .map(|(_, module)| module)
            .ok_or(DriverError(
                cudarc::driver::sys::cudaError_enum::CUDA_ERROR_NOT_FOUND,
            ))?;
        module.load_function(name)
    }
}

#[derive(Debug, Error)]
pub enum GpuError {
    #[error(transparent)]
    Toolkit(#[from] ToolkitError),
    #[error("CUDA driver call failed while {context}: {source}")]
    Driver {
        context: String,
        #[source]
        source: DriverError,
    },
    #[error(
        "no CUDA device is visible (cuDeviceGetCount returned 0); run on a machine with an NVIDIA GPU"
    )]
    NoDevice,
    #[error(
        "this plan cannot run here: {reason}; plan the layer for this device (omit --target, or regenerate the AOT directory on a matching GPU)"
    )]
    TargetMismatch { target: String, reason: String },
    #[error("{wanted} GPUs are needed; {found} visible")]
    TooFewDevices { wanted: usize, found: usize },
    #[error(
        "there is no GPU {ordinal}: {found} visible, numbered from 0 (CUDA_VISIBLE_DEVICES narrows them; a rank process of a group takes GPU LOCAL_RANK)"
    )]
    NoSuchDevice { ordinal: usize, found: usize },
    #[error(
        "device {from} cannot access device {to}'s memory ({result}); expert parallelism across GPUs needs peer access (NVLink or PCIe P2P)"
    )]
    PeerAccess {
        from: usize,
        to: usize,
        result: String,
    },
    #[error("{wanted} 4-byte words were asked of a workspace buffer of {bytes} B")]
    ShortBuffer { wanted: usize, bytes: usize },
    #[error(
        "the CUDA driver cannot load module `{module}` ({source}): its PTX or CUBIN is from a newer CUDA than this driver supports, or was built for another GPU; update the NVIDIA driver (CUDA 13 needs 580 or newer) or compile the layer on this machine (`moeforge compile` again for an AOT directory)"
    )]
    ModuleImage {
        module: String,
        #[source]
        source: DriverError,
    },
}

/// Adds what was being done to a driver error.
pub trait DriverContext<T> {
    fn context(self, context: impl Into<String>) -> Result<T, GpuError>;
}

impl<T> DriverContext<T> for Result<T, DriverError> {
    fn context(self, context: impl Into<String>) -> Result<T, GpuError> {
        self.map_err(|source| GpuError::Driver {
            context: context.into(),
            source,
        })
    }
}

/// Why the driver refused to load module `module`: where the image itself is what it
/// refuses (PTX of a newer CUDA, a CUBIN of another GPU), an error that says what to do.
fn module_load_error(module: &str, source: DriverError) -> GpuError {
    match source.0 {
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        | CUresult::CUDA_ERROR_INVALID_PTX
        | CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
        | CUresult::CUDA_ERROR_INVALID_IMAGE => GpuError::ModuleImage {
            module: module.to_string(),
            source,
        },
        _ => GpuError::Driver {
            context: format!("loading module `{module}`"),
            source,
        },
    }
}

/// One GPU and the stream moeforge works on.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
}

impl Gpu {
    /// Opens device `ordinal`. Event tracking is off: the layer orders its work on one
    /// stream itself, and tracking would add events to every launch.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        toolkit::driver_available()?;
        let count = CudaContext::device_count().context("counting devices")?;
        if count <= 0 {
            return Err(GpuError::NoDevice);
        }
        if i32::try_from(ordinal).map_or(true, |o| o >= count) {
            return Err(GpuError::NoSuchDevice {
                ordinal,
                found: count as usize,
            });
        }
        let ctx = CudaContext::new(ordinal).context(format!("opening device {ordinal}"))?;
        // SAFETY: called before any buffer exists on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().context("creating a stream")?;
        Ok(Gpu { ctx, stream })
    }

    /// The caller's stream, in the caller's context, as moeforge's GPU: a layer built on
    /// it enqueues every launch there, after the caller's earlier work on that stream.
    /// cudarc's per-buffer event tracking does not cover the layer's launches (the events
    /// it records while the launch arguments are gathered precede the launches): where
    /// the context tracks events across several streams (cudarc's default once a second
    /// stream exists), another stream that reads a layer's output, or writes its inputs,
    /// must first wait for an event recorded on this stream after the call. [`Gpu::open`]
    /// turns tracking off, as moeforge orders its own work.
    pub fn with_stream(stream: Arc<CudaStream>) -> Gpu {
        Gpu {
            ctx: Arc::clone(stream.context()),
            stream,
        }
    }

    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|_| "unknown GPU".to_string())
    }

    /// `sm_XYa`-style architecture of the device (the `a` suffix for 9.0, where wgmma lives).
    pub fn arch(&self) -> Result<String, GpuError> {
        let (major, minor) = self
            .ctx
            .compute_capability()
            .context("reading compute capability")?;
        let suffix = if major == 9 { "a" } else { "" };
        Ok(format!("sm_{major}{minor}{suffix}"))
    }

    /// What the planner needs to know about this device.
    pub fn facts(&self) -> Result<DeviceFacts, GpuError> {
        let attribute = |attribute, what: &str| -> Result<u32, GpuError> {
            let value = self
                .ctx
                .attribute(attribute)
                .context(format!("reading the device's {what}"))?;
            Ok(u32::try_from(value).unwrap_or(0))
        };
        Ok(DeviceFacts {
            name: self.name(),
            arch: self.arch()?,
            sm_count: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "SM count",
            )?,
            smem_per_block: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "shared memory per block",
            )?,
            smem_per_sm: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                "shared memory per SM",
            )?,
        })
    }

    /// The planner's target for this device (see [`Target::for_device`]).
    pub fn target(&self) -> Result<Target, GpuError> {
        Ok(Target::for_device(&self.facts()?))
    }

    /// A typed error when `plan` was made for another kind of device.
    pub fn check_target(&self, target: &Target) -> Result<(), GpuError> {
        let facts = self.facts()?;
        match target.mismatch(&facts) {
            Some(reason) => Err(GpuError::TargetMismatch {
                target: target.name.clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Loads a compiled module into another context (another GPU of an expert-parallel
    /// layer): its CUBIN when there is one, else its PTX.
    pub fn load_into(
        ctx: &Arc<CudaContext>,
        module: &CompiledModule,
    ) -> Result<Arc<CudaModule>, GpuError> {
        let image = match &module.cubin {
            Some(cubin) => Ptx::from_binary(cubin.clone()),
            None => Ptx::from_src(module.ptx.clone()),
        };
        ctx.load_module(image)
            .map_err(|source| module_load_error(&module.name, source))
    }

    /// Opens device `ordinal` as one more rank's device: its context, with event tracking
    /// off as for [`Gpu::open`].
    pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, GpuError> {
        toolkit::driver_available()?;
        let count = CudaContext::device_count().context("counting devices")?;
        if i32::try_from(ordinal).map_or(true, |o| o >= count) {
            return Err(GpuError::TooFewDevices {
                wanted: ordinal + 1,
                found: count.max(0) as usize,
            });
        }
        let ctx = CudaContext::new(ordinal).context(format!("opening device {ordinal}"))?;
        // SAFETY: called before any buffer exists on this context... unless it is the
        // primary context another handle already uses, whose tracking is off too.
        unsafe { ctx.disable_event_tracking() };
        Ok(ctx)
    }

    /// Loads a compiled module: its CUBIN when there is one, else its PTX.
    pub fn load(&self, module: &CompiledModule) -> Result<Arc<CudaModule>, GpuError> {
        Gpu::load_into(&self.ctx, module)
    }

    /// Loads the kernels of a layer that it launches (`entry_points`, e.g.
    /// [`Plan::single_gpu_entry_points`](moeforge_compiler::plan::Plan::single_gpu_entry_points)):
    /// each module that holds one of them.
    pub fn load_kernels(
        &self,
        kernels: &CompiledKernels,
        entry_points: &[String],
    ) -> Result<LoadedKernels, GpuError> {
        Gpu::load_kernels_into(&self.ctx, kernels, entry_points)
    }

    /// Loads a layer's kernels into another context (another GPU of an expert-parallel
    /// layer); see [`Gpu::load_kernels`].
    pub fn load_kernels_into(
        ctx: &Arc<CudaContext>,
        kernels: &CompiledKernels,
        entry_points: &[String],
    ) -> Result<LoadedKernels, GpuError> {
        let modules = kernels
            .modules_for(entry_points)
            .map(|m| Ok((m.kernels.clone(), Gpu::load_into(ctx, &m.module)?)))
            .collect::<Result<_, GpuError>>()?;
        Ok(LoadedKernels { modules })
    }

    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream
            .synchronize()
            .context("synchronising the stream")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Only the variants: a DriverError's text comes from libcuda, absent on CPU machines.
    #[test]
    fn an_image_the_driver_refuses_gets_its_own_error() {
        let refused = module_load_error(
            "tiny",
            DriverError(CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION),
        );
        assert!(matches!(refused, GpuError::ModuleImage { ref module, .. } if module == "tiny"));
        let other = module_load_error("tiny", DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(matches!(other, GpuError::Driver { .. }));
    }
}
