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
//! of two neighbouring stages directly, with a watchdog that aborts instead of hanging; a stage
//! keeps the boundary tensors of such links on its GPU (`stage`'s device links).
//!
//! With the `emulate` feature (tests only) there is no CUDA at all: `device_emu` runs the same
//! `kernels.cu` on the CPU through the CUDA shim of `emu/` and the matrix products as plain loops,
//! so the whole GPU stage — its Seq1F1B bookkeeping, caches, gradient tree and state copies — is
//! tested against the CPU stage on machines without a GPU; `nccl_emu` stands in for NCCL.

#![deny(missing_docs)]

pub mod compile;
#[cfg(not(feature = "emulate"))]
mod device;
#[cfg(feature = "emulate")]
#[path = "device_emu.rs"]
mod device;
mod error;
pub mod gemm_bench;
pub mod info;
mod kernels;
pub mod link;
#[cfg(not(feature = "emulate"))]
pub mod nccl;
#[cfg(feature = "emulate")]
#[path = "nccl_emu.rs"]
pub mod nccl;
#[cfg(not(feature = "emulate"))]
pub mod offload;
#[cfg(feature = "emulate")]
#[path = "offload_emu.rs"]
pub mod offload;
pub mod oracle;
pub mod profile;
pub mod stage;
mod staging;
mod types;

pub use device::{Buf, Gpu, Precision, device_count, libraries_present};
pub use error::{GpuError, Result};
pub use kernels::{AttnShape, DocStarts, NormSaved, position_doc_starts};
pub use profile::Profile;
pub use types::{AttentionKernels, Bf16Path};
