//! Compiling `kernels.cu` to PTX with NVRTC for one architecture, cached on disk by a hash of the
//! source, the architecture and the options (a process that starts a stage does not pay the
//! compile again).

use std::path::PathBuf;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use crate::error::{GpuError, Result};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel's symbol, in the order the source defines them.
pub const KERNELS: &[&str] = &[
    "embed_forward",
    "embed_backward_tokens",
    "embed_backward_positions",
    "column_sum_partial",
    "column_sum_finish",
    "add_bias",
    "add",
    "add_assign",
    "copy_rows",
    "bias_gelu_forward",
    "gelu_backward",
    "norm_forward",
    "norm_backward_input",
    "norm_backward_params_partial",
    "rope",
    "attn_backward_delta",
    "softmax_cross_entropy",
    "adamw",
    "sum_squares_partial",
    "sum_squares_finish",
    "to_bf16",
];

/// Head widths the attention kernels are instantiated for.
pub const HEAD_DIMS: &[usize] = &[16, 32, 64, 128];

/// The attention kernels' symbols for every head width.
pub fn attention_kernels() -> Vec<String> {
    HEAD_DIMS
        .iter()
        .flat_map(|d| {
            [
                "attn_forward",
                "attn_backward_dq",
                "attn_backward_dkdv",
                "attn_tc_forward",
                "attn_tc_backward_dq",
                "attn_tc_backward_dkdv",
            ]
            .map(|k| format!("{k}_d{d}"))
        })
        .collect()
}

/// Whether NVRTC can be loaded (checked before any call into it: cudarc panics otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// The oldest compute capability CUDA 13's NVRTC compiles for (Turing); older GPUs are refused
/// when opened.
pub const OLDEST_CAPABILITY: (i32, i32) = (7, 5);

/// The architecture option for compute capability `(major, minor)` (at least
/// [`OLDEST_CAPABILITY`]), e.g. `sm_90`.
pub fn arch_for(major: i32, minor: i32) -> &'static str {
    // NVRTC takes a `&'static str`; the handful of capabilities seqpipe targets are listed.
    match (major, minor) {
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (m, _) if m >= 12 => "sm_120",
        (m, _) if m >= 10 => "sm_100",
        (9, _) => "sm_90",
        (8, _) => "sm_80",
        _ => "sm_75",
    }
}

fn options(arch: &'static str) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    }
}

/// Compiles the kernels for `arch` (e.g. `sm_90`). Needs only NVRTC, no GPU.
pub fn compile_ptx(arch: &'static str) -> Result<Ptx> {
    if !nvrtc_present() {
        return Err(GpuError::MissingLibrary {
            what: "NVRTC",
            names: "libnvrtc.so.13",
            hint: "install the nvidia-cuda-nvrtc wheel (scripts/test.sh does) and put its lib/ directory on LD_LIBRARY_PATH",
        });
    }
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options(arch)).map_err(|e| GpuError::Compile {
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

/// The architectures `seqpipe gpu ptx` accepts: those [`arch_for`] returns.
pub const ARCHS: &[&str] = &[
    "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120",
];

/// Where [`cached_ptx`] keeps the kernels of `arch` (this source, these options), if anywhere.
pub fn cache_file(arch: &'static str) -> Option<PathBuf> {
    let key = blake3::hash(format!("{arch}\n{:?}\n{SOURCE}", options(arch).options).as_bytes());
    cache_dir().map(|d| d.join(format!("kernels-{arch}-{}.ptx", &key.to_hex()[..16])))
}

/// [`compile_ptx`] through a cache under `$SEQPIPE_CACHE` (default `~/.cache/seqpipe/ptx`).
/// `seqpipe gpu ptx` fills it ahead of time (NVRTC only, no GPU), e.g. once for a cluster's image.
pub fn cached_ptx(arch: &'static str) -> Result<Ptx> {
    let path = cache_file(arch);
    if let Some(path) = &path
        && let Ok(text) = std::fs::read_to_string(path)
    {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile_ptx(arch)?;
    if let Some(path) = &path {
        // A cache that cannot be written only costs the next start a compile.
        let _ = std::fs::create_dir_all(path.parent().expect("a file in a directory"));
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, ptx.to_src()).is_ok() {
            let _ = std::fs::rename(&tmp, path);
        }
    }
    Ok(ptx)
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SEQPIPE_CACHE") {
        return Some(PathBuf::from(dir).join("ptx"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/seqpipe/ptx"))
}
