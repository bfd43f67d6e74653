//! What can go wrong on the GPU path, with what to do about it.

use thiserror::Error;

/// Errors of the CUDA path.
#[derive(Debug, Error)]
pub enum GpuError {
    /// A CUDA library could not be loaded (no driver, or a toolkit library not on the library path).
    #[error("the CUDA {what} library could not be loaded ({names}); {hint}")]
    MissingLibrary {
        /// Which library.
        what: &'static str,
        /// The file names that were tried.
        names: &'static str,
        /// What to do.
        hint: &'static str,
    },
    /// The driver has no GPU to offer.
    #[error(
        "no CUDA GPU is visible (device count {count}, asked for device {ordinal}): run on a machine with an NVIDIA GPU, check CUDA_VISIBLE_DEVICES, or use model.device = \"cpu\""
    )]
    NoDevice {
        /// Devices the driver reports.
        count: i32,
        /// Device asked for.
        ordinal: usize,
    },
    /// The GPU is older than CUDA 13 supports.
    #[error(
        "{name} has compute capability {major}.{minor}; the CUDA kernels need 7.5 (Turing) or newer: use a newer GPU or model.device = \"cpu\""
    )]
    UnsupportedDevice {
        /// The device's name.
        name: String,
        /// Compute capability, major.
        major: i32,
        /// Compute capability, minor.
        minor: i32,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed during {during}: {source}")]
    Driver {
        /// What was being done.
        during: String,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS failed during {during}: {source:?}")]
    Blas {
        /// What was being done.
        during: String,
        /// cuBLAS's error.
        source: cudarc::cublas::result::CublasError,
    },
    /// An NCCL call failed.
    #[error("NCCL failed during {during}: {detail}")]
    Nccl {
        /// What was being done.
        during: String,
        /// NCCL's result code and message.
        detail: String,
    },
    /// An NCCL link was aborted instead of waiting for a peer that does not answer.
    #[error(
        "NCCL link aborted during {during}: {why}; the peer is treated as lost (recovery rebuilds the link)"
    )]
    LinkAborted {
        /// What was being done.
        during: String,
        /// Why it was aborted.
        why: String,
    },
    /// NVRTC could not compile the kernels.
    #[error("NVRTC could not compile kernels.cu for {arch}: {log}")]
    Compile {
        /// Target architecture.
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// The kernel cache could not be read or written.
    #[error("kernel cache {}: {detail}", path.display())]
    Cache {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What went wrong and what to do.
        detail: String,
    },
    /// Inputs of a kernel do not fit together.
    #[error("{op}: {reason}")]
    Shape {
        /// The kernel.
        op: &'static str,
        /// What does not fit.
        reason: String,
    },
    /// Document masks asked of attention kernels that take no document starts (the v1
    /// tensor-core kernels, `SEQPIPE_ATTENTION=v1`).
    #[error(
        "{op}: the {kernels} attention kernels take no document starts; unset SEQPIPE_ATTENTION (v2, the default, masks) or set data.document_mask = false"
    )]
    MaskUnsupported {
        /// The kernel call.
        op: &'static str,
        /// Which kernels (`tensor-core v1`).
        kernels: &'static str,
    },
    /// An environment variable the GPU reads holds a value it does not accept.
    #[error("{name}={value:?}: {reason}")]
    Env {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what is accepted.
        reason: String,
    },
    /// A CPU oracle kernel failed.
    #[error("CPU oracle: {0}")]
    Oracle(String),
    /// The model refused (the step's gradient bookkeeping: units out of order, no step begun).
    #[error(transparent)]
    Model(#[from] model::ModelError),
}

/// Result of the GPU path.
pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// Attaches a description to driver errors.
#[cfg_attr(feature = "emulate", allow(dead_code))]
pub(crate) trait DriverContext<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| GpuError::Driver {
            during: what(),
            source,
        })
    }
}

pub(crate) fn shape<T>(op: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(GpuError::Shape {
        op,
        reason: reason.into(),
    })
}
