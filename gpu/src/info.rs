//! What `seqpipe gpu info` reports before anything runs on a GPU (gpu-check's preflight): the
//! device, its compute capability and memory, the driver's version, the CUDA library files this
//! process actually mapped (cudarc tries the unversioned `libX.so` first, so a toolkit's copy under
//! /usr/local/cuda can win over a wheel's: only `/proc/self/maps` says which was loaded), NCCL's
//! version, and the kernel image the GPU loaded (cubin or PTX JIT). A missing library or a GPU
//! that does not open is a field saying so, never a panic.

use serde::Serialize;

/// The CUDA libraries seqpipe loads, as (file name stem, what it is).
pub const LIBRARIES: &[(&str, &str)] = &[
    ("libcuda", "driver"),
    ("libnvrtc", "NVRTC"),
    ("libcublas", "cuBLAS"),
    ("libcublasLt", "cuBLASLt"),
    ("libnccl", "NCCL"),
];

/// One library's state in this process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Library {
    /// Loaded from these files (more than one: two copies are mapped, worth knowing).
    Loaded(Vec<String>),
    /// Not loadable, and why.
    Missing(String),
    /// Not used by this build (the CPU emulation).
    NotUsed(String),
}

/// The report, printed as one JSON line.
#[derive(Debug, Clone, Serialize)]
pub struct GpuInfo {
    /// Whether the GPU was opened (kernels loaded, cuBLAS handle created).
    pub opened: bool,
    /// Why it was not.
    pub error: Option<String>,
    /// Device ordinal asked for.
    pub ordinal: usize,
    /// The device's name.
    pub device: Option<String>,
    /// `major.minor`.
    pub compute_capability: Option<String>,
    /// Device memory in bytes.
    pub memory_total_bytes: Option<u64>,
    /// Free device memory in bytes.
    pub memory_free_bytes: Option<u64>,
    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. `13.0`), or why it is unknown.
    pub driver_version: String,
    /// Each CUDA library by file name stem (`libcublas`, …).
    pub libraries: std::collections::BTreeMap<String, Library>,
    /// `major.minor.patch` (`ncclGetVersion`), or why it is unavailable.
    pub nccl_version: String,
    /// The kernel image loaded: `cubin sm_90`, `PTX JIT sm_90`, `emulated`.
    pub kernel_image: Option<String>,
    /// The CPU emulation of the GPU (`emulate` feature).
    pub emulated: bool,
}

/// The files mapped into a process (the text of `/proc/<pid>/maps`) that are the library `stem`:
/// file names `stem.so` or `stem.so.<version>` (so `libcublas` does not match `libcublasLt.so`),
/// each once, in order of first appearance.
pub fn mapped_files(maps: &str, stem: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in maps.lines() {
        // address perms offset dev inode [path]: the path is the sixth field (may hold spaces).
        let Some(path) = line.splitn(6, ' ').nth(5).map(str::trim) else {
            continue;
        };
        let name = path.rsplit('/').next().unwrap_or(path);
        let Some(rest) = name.strip_prefix(stem).and_then(|r| r.strip_prefix(".so")) else {
            continue;
        };
        if (rest.is_empty() || rest.starts_with('.')) && !out.iter().any(|p| p == path) {
            out.push(path.to_string());
        }
    }
    out
}

/// Collects the report for device `ordinal`.
#[cfg(not(feature = "emulate"))]
pub fn collect(ordinal: usize) -> GpuInfo {
    use cudarc::{cublas, cublaslt, driver, nccl, nvrtc};

    // Load each present library the way cudarc does (its `culib()` keeps it loaded), so that the
    // maps show the files cudarc picked, whether or not opening the GPU gets that far.
    // SAFETY: `is_culib_present` only tries to dlopen; `culib` loads a library found present.
    let present = unsafe {
        [
            driver::sys::is_culib_present() && {
                driver::sys::culib();
                true
            },
            nvrtc::sys::is_culib_present() && {
                nvrtc::sys::culib();
                true
            },
            cublas::sys::is_culib_present() && {
                cublas::sys::culib();
                true
            },
            cublaslt::sys::is_culib_present() && {
                cublaslt::sys::culib();
                true
            },
            nccl::sys::is_culib_present() && {
                nccl::sys::culib();
                true
            },
        ]
    };
    let opened = crate::Gpu::open(ordinal, crate::Precision::Fp32);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let libraries = LIBRARIES
        .iter()
        .zip(present)
        .map(|(&(stem, what), present)| {
            let files = mapped_files(&maps, stem);
            let state = if !files.is_empty() {
                Library::Loaded(files)
            } else if present {
                Library::Missing(format!("{what} was found but is not mapped (/proc/self/maps unreadable?)"))
            } else {
                Library::Missing(format!(
                    "{what}: no {stem}.so or {stem}.so.<version> on the library path (LD_LIBRARY_PATH, ldconfig)"
                ))
            };
            (stem.to_string(), state)
        })
        .collect();
    let driver_version = if present[0] {
        let mut v = 0;
        // SAFETY: the library is loaded; `v` outlives the call.
        match unsafe { driver::sys::cuDriverGetVersion(&mut v) }.result() {
            Ok(()) => format!("{}.{}", v / 1000, v % 1000 / 10),
            Err(e) => format!("unavailable: cuDriverGetVersion failed: {e:?}"),
        }
    } else {
        "unavailable: no driver library (libcuda.so.1)".into()
    };
    let nccl_version = match crate::nccl::nccl_version() {
        Ok((a, b, c)) => format!("{a}.{b}.{c}"),
        Err(e) => format!("unavailable: {e}"),
    };
    let mut info = GpuInfo {
        opened: false,
        error: None,
        ordinal,
        device: None,
        compute_capability: None,
        memory_total_bytes: None,
        memory_free_bytes: None,
        driver_version,
        libraries,
        nccl_version,
        kernel_image: None,
        emulated: false,
    };
    match opened {
        Ok(g) => {
            info.opened = true;
            info.device = Some(g.name().to_string());
            let (major, minor) = g.capability();
            info.compute_capability = Some(format!("{major}.{minor}"));
            match g.memory() {
                Ok((free, total)) => {
                    info.memory_free_bytes = Some(free as u64);
                    info.memory_total_bytes = Some(total as u64);
                }
                Err(e) => info.error = Some(format!("reading memory: {e}")),
            }
            info.kernel_image = Some(g.kernel_image().to_string());
        }
        Err(e) => info.error = Some(e.to_string()),
    }
    info
}

/// Collects the report on the CPU emulation: no CUDA library is used.
#[cfg(feature = "emulate")]
pub fn collect(ordinal: usize) -> GpuInfo {
    let libraries = LIBRARIES
        .iter()
        .map(|&(stem, _)| {
            (
                stem.to_string(),
                Library::NotUsed("emulated: the kernels run on the CPU".into()),
            )
        })
        .collect();
    let mut info = GpuInfo {
        opened: false,
        error: None,
        ordinal,
        device: None,
        compute_capability: None,
        memory_total_bytes: None,
        memory_free_bytes: None,
        driver_version: "emulated".into(),
        libraries,
        nccl_version: "emulated (TCP stand-in)".into(),
        kernel_image: None,
        emulated: true,
    };
    match crate::Gpu::open(ordinal, crate::Precision::Fp32) {
        Ok(g) => {
            info.opened = true;
            info.device = Some(g.name().to_string());
            info.kernel_image = Some(g.kernel_image().to_string());
            if let Ok((free, total)) = g.memory() {
                info.memory_free_bytes = Some(free as u64);
                info.memory_total_bytes = Some(total as u64);
            }
        }
        Err(e) => info.error = Some(e.to_string()),
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_give_each_library_its_own_files() {
        let maps = "\
7f00-7f01 r--p 00000000 08:01 123 /usr/local/cuda/lib64/libcublas.so.13.0.0.19
7f01-7f02 r-xp 00001000 08:01 123 /usr/local/cuda/lib64/libcublas.so.13.0.0.19
7f02-7f03 r--p 00000000 08:01 124 /venv/site-packages/nvidia/cu13/lib/libcublasLt.so.13
7f03-7f04 r--p 00000000 08:01 125 /usr/lib/x86_64-linux-gnu/libcuda.so.580.1
7f04-7f05 rw-p 00000000 00:00 0 
7f05-7f06 r--p 00000000 08:01 126 /venv/site-packages/nvidia/cu13/lib/libnvrtc.so.13
7f06-7f07 r--p 00000000 08:01 127 /venv/site-packages/nvidia/cu13/lib/libnvrtc-builtins.so.13.0
7f07-7f08 r--p 00000000 08:01 128 /tmp/links dir/libnccl.so
7f08-7f09 r--p 00000000 08:01 129 /usr/lib/libcudart.so.13
7f09-7f0a r--p 00000000 08:01 130 /venv/nvidia/cu13/lib/libcublas.so.13
";
        assert_eq!(
            mapped_files(maps, "libcublas"),
            [
                "/usr/local/cuda/lib64/libcublas.so.13.0.0.19",
                "/venv/nvidia/cu13/lib/libcublas.so.13"
            ]
        );
        assert_eq!(
            mapped_files(maps, "libcublasLt"),
            ["/venv/site-packages/nvidia/cu13/lib/libcublasLt.so.13"]
        );
        assert_eq!(
            mapped_files(maps, "libcuda"),
            ["/usr/lib/x86_64-linux-gnu/libcuda.so.580.1"]
        );
        assert_eq!(
            mapped_files(maps, "libnvrtc"),
            ["/venv/site-packages/nvidia/cu13/lib/libnvrtc.so.13"]
        );
        assert_eq!(mapped_files(maps, "libnccl"), ["/tmp/links dir/libnccl.so"]);
        assert!(mapped_files("", "libcuda").is_empty());
    }

    #[test]
    fn a_machine_without_cuda_gets_a_report_not_a_panic() {
        // CI has no driver: the report says the GPU did not open and why, and each library
        // is either mapped or missing with a reason. (With the emulation: everything "not used".)
        let info = collect(0);
        assert_eq!(info.libraries.len(), LIBRARIES.len());
        if !info.opened {
            assert!(
                info.error.as_deref().is_some_and(|e| !e.is_empty()),
                "{info:?}"
            );
            assert!(info.kernel_image.is_none());
        }
        if info.emulated {
            assert!(info.opened);
            assert_eq!(info.kernel_image.as_deref(), Some("emulated"));
        }
    }
}
