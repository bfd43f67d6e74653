//! CUDA stages for seqpipe: the GPU counterparts of the CPU kernels in `ops`, compiled at run time
//! by NVRTC for the device's compute capability (`kernels.cu`), matrix products through cuBLAS, and
//! a pipeline stage of a GPT built from them (`stage`). The CPU kernels stay the oracle: `oracle`
//! runs every kernel on random inputs on both and reports their relative differences.
//!
//! Nothing here links CUDA at build time: cudarc loads `libcuda`, `libnvrtc` and `libcublas` when a
//! [`Gpu`] is opened, and their absence is a [`GpuError`], never a panic. The kernels compile to
//! PTX without a GPU ([`compile::compile_ptx`]), which the tests do for sm_80 and sm_90.
//!
//! State copies to the host run on a second stream behind the compute (`offload`), so a
//! checkpoint or peer snapshot costs the step only the queueing of the copy. `nccl` links the GPUs
//! of two neighbouring stages directly, with a watchdog that aborts instead of hanging.

#![deny(missing_docs)]

pub mod compile;
mod device;
mod error;
mod kernels;
pub mod nccl;
pub mod offload;
pub mod oracle;
pub mod stage;

pub use device::{Buf, Gpu, Precision, device_count, libraries_present};
pub use error::{GpuError, Result};
pub use kernels::AttnShape;
