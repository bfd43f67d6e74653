//! Compiling `kernels.cu` with NVRTC for one architecture into PTX and a cubin (the machine code
//! of that architecture), cached on disk under a hash of the source, the architecture and the
//! options, so a process that starts a stage pays neither the NVRTC compile nor the driver's PTX
//! JIT (ptxas takes tens of seconds for these kernels).
//!
//! A GPU loads the cached cubin of its architecture when one is there and intact (its content hash
//! is in a sidecar file, its architecture in its ELF header), falls back to the cached PTX (which
//! the driver JIT-compiles) otherwise, and compiles both when neither is cached. Which it did is a
//! pure decision, [`choose_image`], over what [`inspect_cache`] found.

use std::ffi::{CStr, CString, c_char};
use std::fmt;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::{Ptx, result as nvrtc, sys as nvrtc_sys};

use crate::error::{GpuError, Result};

/// The CUDA C source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// Every kernel's symbol, in the order the source defines them.
pub const KERNELS: &[&str] = &[
    "embed_forward",
    "embed_backward_tokens",
    "embed_backward_positions",
    "embed_backward_positions_reset",
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
    "attn_tc2_backward_delta",
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
                "attn_tc2_forward",
                "attn_tc2_backward_dq",
                "attn_tc2_backward_dkdv",
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

const OPTIONS: &[&str] = &["--std=c++17"];

/// NVRTC's options for `arch`.
fn options(arch: &str) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}")];
    o.extend(OPTIONS.iter().map(|s| s.to_string()));
    o
}

/// The kernels compiled for one architecture.
pub struct Compiled {
    /// The PTX (portable: the driver can JIT it for this architecture or a newer one).
    pub ptx: String,
    /// The cubin: an ELF of machine code for exactly this architecture (and later minor versions
    /// of the same major one).
    pub cubin: Vec<u8>,
}

/// Compiles the kernels for `arch` (e.g. `sm_90`) into PTX and a cubin. Needs only NVRTC, no GPU.
pub fn compile(arch: &str) -> Result<Compiled> {
    if !nvrtc_present() {
        return Err(GpuError::MissingLibrary {
            what: "NVRTC",
            names: "libnvrtc.so.13",
            hint: "install the nvidia-cuda-nvrtc wheel (scripts/test.sh does) and put its lib/ directory on LD_LIBRARY_PATH",
        });
    }
    let failed = |what: &str, e: nvrtc::NvrtcError| GpuError::Compile {
        arch: arch.to_string(),
        log: format!("{what}: {e:?}"),
    };
    let src = CString::new(SOURCE).expect("kernels.cu has no NUL byte");
    let name = CString::new("kernels.cu").expect("no NUL byte");
    let prog = Program(
        nvrtc::create_program(&src, Some(&name)).map_err(|e| failed("creating the program", e))?,
    );
    // SAFETY: the program is live; the options are plain strings.
    if let Err(e) = unsafe { nvrtc::compile_program(prog.0, &options(arch)) } {
        // SAFETY: as above; the log is NUL-terminated.
        let log = unsafe { nvrtc::get_program_log(prog.0) }
            .map(|l| {
                unsafe { CStr::from_ptr(l.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_else(|e2| format!("{e:?} (and no log: {e2:?})"));
        return Err(GpuError::Compile {
            arch: arch.to_string(),
            log,
        });
    }
    // SAFETY: the program compiled; get_ptx returns a NUL-terminated buffer.
    let ptx = unsafe { nvrtc::get_ptx(prog.0) }.map_err(|e| failed("reading the PTX", e))?;
    let ptx = unsafe { CStr::from_ptr(ptx.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    let cubin = prog.cubin().map_err(|e| failed("reading the cubin", e))?;
    if cubin.is_empty() {
        return Err(GpuError::Compile {
            arch: arch.to_string(),
            log: "NVRTC produced no cubin (only a real architecture sm_XX has one)".into(),
        });
    }
    Ok(Compiled { ptx, cubin })
}

/// An NVRTC program, destroyed on drop (an error there is ignored: the program is gone either way).
struct Program(nvrtc_sys::nvrtcProgram);

impl Program {
    /// `nvrtcGetCUBIN` (cudarc's safe layer only offers the PTX).
    fn cubin(&self) -> std::result::Result<Vec<u8>, nvrtc::NvrtcError> {
        let mut size = 0usize;
        // SAFETY: the program is live and compiled; `size` outlives the call.
        unsafe { nvrtc_sys::nvrtcGetCUBINSize(self.0, &mut size) }.result()?;
        let mut out = vec![0u8; size];
        if size > 0 {
            // SAFETY: `out` holds the `size` bytes NVRTC writes.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(self.0, out.as_mut_ptr() as *mut c_char) }
                .result()?;
        }
        Ok(out)
    }
}

impl fmt::Debug for Compiled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Compiled {{ ptx: {} bytes, cubin: {} bytes }}",
            self.ptx.len(),
            self.cubin.len()
        )
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program`, destroyed once.
        let _ = unsafe { nvrtc::destroy_program(self.0) };
    }
}

/// Compiles the kernels for `arch` (e.g. `sm_90`) to PTX. Needs only NVRTC, no GPU.
pub fn compile_ptx(arch: &str) -> Result<Ptx> {
    compile(arch).map(|c| Ptx::from_src(c.ptx))
}

/// The architectures `seqpipe gpu ptx` accepts: those [`arch_for`] returns.
pub const ARCHS: &[&str] = &[
    "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120",
];

/// The cache files of one architecture (this source, these options).
#[derive(Debug, Clone)]
pub struct CacheFiles {
    /// The PTX.
    pub ptx: PathBuf,
    /// The cubin.
    pub cubin: PathBuf,
    /// The cubin's BLAKE3 hash (hex), written after the cubin: a cubin without a matching
    /// sidecar is never loaded.
    pub cubin_hash: PathBuf,
}

impl CacheFiles {
    /// The files of `arch` under `dir`.
    pub fn in_dir(dir: &Path, arch: &str) -> CacheFiles {
        let key = blake3::hash(format!("{arch}\n{OPTIONS:?}\n{SOURCE}").as_bytes());
        let stem = format!("kernels-{arch}-{}", &key.to_hex()[..16]);
        CacheFiles {
            ptx: dir.join(format!("{stem}.ptx")),
            cubin: dir.join(format!("{stem}.cubin")),
            cubin_hash: dir.join(format!("{stem}.cubin.blake3")),
        }
    }
}

/// Where [`cached_ptx`] keeps the PTX of `arch` (this source, these options), if anywhere.
pub fn cache_file(arch: &str) -> Option<PathBuf> {
    cache_files(arch).map(|f| f.ptx)
}

/// The cache files of `arch` under `$SEQPIPE_CACHE` (default `~/.cache/seqpipe`), if there is a
/// cache directory.
pub fn cache_files(arch: &str) -> Option<CacheFiles> {
    cache_dir().map(|d| CacheFiles::in_dir(&d, arch))
}

/// The SM version (e.g. 90) a cubin was built for, read from its ELF header, or why it is not a
/// CUDA cubin. CUDA ELF files have machine `EM_CUDA` (190); the SM version is the low byte of
/// `e_flags` before ELF ABI version 8 and the second byte from version 8 on (CUDA 12.8+; NVRTC 13
/// writes `e_flags` 0x6005a04 for sm_90, checked).
pub fn cubin_sm(image: &[u8]) -> std::result::Result<u32, String> {
    if image.len() < 64 || &image[..4] != b"\x7fELF" {
        return Err("not an ELF file".into());
    }
    if image[4] != 2 || image[5] != 1 {
        return Err("not a 64-bit little-endian ELF".into());
    }
    let machine = u16::from_le_bytes([image[18], image[19]]);
    if machine != 190 {
        return Err(format!("ELF machine {machine}, not CUDA (190)"));
    }
    let flags = u32::from_le_bytes([image[48], image[49], image[50], image[51]]);
    let sm = if image[8] >= 8 {
        (flags >> 8) & 0xff
    } else {
        flags & 0xff
    };
    Ok(sm)
}

/// The SM version of `arch` (`sm_90` → 90).
fn sm_of(arch: &str) -> Option<u32> {
    arch.strip_prefix("sm_")?.parse().ok()
}

/// What the cache holds for one architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CachedCubin {
    /// No cubin file.
    Absent,
    /// A cubin whose hash matches its sidecar, built for SM version `sm`.
    Intact {
        /// The SM version in its ELF header.
        sm: u32,
    },
    /// A cubin that must not be loaded, and why.
    Damaged(String),
}

/// What [`inspect_cache`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheContents {
    /// The cubin.
    pub cubin: CachedCubin,
    /// Whether a PTX file is there.
    pub ptx: bool,
}

/// Reads what the cache holds in `files` (no GPU, no NVRTC).
pub fn inspect_cache(files: &CacheFiles) -> CacheContents {
    let cubin = match std::fs::read(&files.cubin) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => CachedCubin::Absent,
        Err(e) => CachedCubin::Damaged(format!("unreadable: {e}")),
        Ok(image) => check_cubin(&image, files),
    };
    CacheContents {
        cubin,
        ptx: files.ptx.is_file(),
    }
}

fn check_cubin(image: &[u8], files: &CacheFiles) -> CachedCubin {
    let want = match std::fs::read_to_string(&files.cubin_hash) {
        Ok(h) => h.trim().to_string(),
        Err(e) => {
            return CachedCubin::Damaged(format!(
                "no hash sidecar {}: {e}",
                files.cubin_hash.display()
            ));
        }
    };
    let got = blake3::hash(image).to_hex().to_string();
    if got != want {
        return CachedCubin::Damaged(format!(
            "content hash {} does not match the sidecar's {}",
            &got[..16],
            want.get(..16).unwrap_or(&want)
        ));
    }
    match cubin_sm(image) {
        Ok(sm) => CachedCubin::Intact { sm },
        Err(why) => CachedCubin::Damaged(why),
    }
}

/// How a GPU gets its kernels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageChoice {
    /// Load the cached cubin (no compile, no JIT).
    Cubin,
    /// Load the cached PTX: the driver JIT-compiles it. `why` says why not the cubin.
    Ptx {
        /// Why the cubin is not used.
        why: String,
    },
    /// Compile with NVRTC (and fill the cache), then load the new cubin. `why` says why.
    Compile {
        /// Why nothing cached is used.
        why: String,
    },
}

/// Chooses how a device of compute capability `(major, minor)` gets the kernels of `arch`
/// (= [`arch_for`]`(major, minor)`) from what the cache holds: an intact cubin of the same major
/// version and no newer minor one than the device (a cubin runs on its own and later minor
/// versions) is loaded; otherwise the PTX is JIT-compiled when there is one; otherwise (or when
/// the cubin is damaged, so that the compile rewrites it) NVRTC compiles both.
pub fn choose_image(capability: (i32, i32), arch: &str, cached: &CacheContents) -> ImageChoice {
    let device_sm = (capability.0 * 10 + capability.1) as u32;
    match &cached.cubin {
        CachedCubin::Intact { sm } => {
            let runs = sm / 10 == device_sm / 10 && *sm <= device_sm;
            if runs && Some(*sm) == sm_of(arch) {
                return ImageChoice::Cubin;
            }
            let why = format!(
                "the cached cubin is for sm_{sm}, the device is sm_{device_sm} (wanted {arch})"
            );
            if cached.ptx {
                ImageChoice::Ptx { why }
            } else {
                ImageChoice::Compile { why }
            }
        }
        CachedCubin::Damaged(reason) => ImageChoice::Compile {
            why: format!("the cached cubin for {arch} is damaged ({reason}); rebuilding it"),
        },
        CachedCubin::Absent if cached.ptx => ImageChoice::Ptx {
            why: format!("no cubin for {arch} in the cache"),
        },
        CachedCubin::Absent => ImageChoice::Compile {
            why: format!("nothing for {arch} in the cache"),
        },
    }
}

/// The kernel image a GPU loaded, as `gpu info` and the open's stderr line say it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadedImage {
    /// A cubin (cached or just compiled), with its architecture.
    Cubin(String),
    /// PTX compiled by the driver's JIT, with the architecture it targets.
    PtxJit(String),
    /// The CPU emulation (`emulate` feature): no image at all.
    Emulated,
}

impl fmt::Display for LoadedImage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadedImage::Cubin(a) => write!(f, "cubin {a}"),
            LoadedImage::PtxJit(a) => write!(f, "PTX JIT {a}"),
            LoadedImage::Emulated => write!(f, "emulated"),
        }
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename (a reader never sees half a file).
fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Writes `compiled` into `files`: PTX, cubin, then the cubin's hash (last, so that a cubin is
/// trusted only once complete).
pub fn store(files: &CacheFiles, compiled: &Compiled) -> std::io::Result<()> {
    write_atomically(&files.ptx, compiled.ptx.as_bytes())?;
    // A stale sidecar must not vouch for a new cubin while it is written.
    let _ = std::fs::remove_file(&files.cubin_hash);
    write_atomically(&files.cubin, &compiled.cubin)?;
    write_atomically(
        &files.cubin_hash,
        blake3::hash(&compiled.cubin).to_hex().as_bytes(),
    )
}

/// Compiles the kernels for `arch` into the cache unless it already holds an intact cubin and the
/// PTX; returns the files and whether it compiled. `seqpipe gpu ptx` runs this ahead of time
/// (NVRTC only, no GPU), e.g. once for a cluster's image.
pub fn fill_cache(arch: &str) -> Result<(CacheFiles, bool)> {
    let files = cache_files(arch).ok_or_else(|| GpuError::Cache {
        path: PathBuf::from("$SEQPIPE_CACHE"),
        detail: "no cache directory: set SEQPIPE_CACHE (or HOME)".into(),
    })?;
    let cached = inspect_cache(&files);
    if cached.ptx && matches!(cached.cubin, CachedCubin::Intact { sm } if Some(sm) == sm_of(arch)) {
        return Ok((files, false));
    }
    let compiled = compile(arch)?;
    store(&files, &compiled).map_err(|e| GpuError::Cache {
        path: files.cubin.clone(),
        detail: e.to_string(),
    })?;
    Ok((files, true))
}

/// The kernels for a device of compute capability `capability`, as [`choose_image`] decides:
/// the module image to load and what it is. A compile fills the cache (a cache that cannot be
/// written only costs the next start a compile).
pub fn kernel_image(capability: (i32, i32)) -> Result<(Ptx, LoadedImage, String)> {
    let arch = arch_for(capability.0, capability.1);
    let files = cache_files(arch);
    let cached = files.as_ref().map(inspect_cache).unwrap_or(CacheContents {
        cubin: CachedCubin::Absent,
        ptx: false,
    });
    let read = |p: &Path| {
        std::fs::read(p).map_err(|e| GpuError::Cache {
            path: p.to_path_buf(),
            detail: e.to_string(),
        })
    };
    match (choose_image(capability, arch, &cached), &files) {
        (ImageChoice::Cubin, Some(f)) => Ok((
            Ptx::from_binary(read(&f.cubin)?),
            LoadedImage::Cubin(arch.into()),
            format!("cached {}", f.cubin.display()),
        )),
        (ImageChoice::Ptx { why }, Some(f)) => {
            let text = String::from_utf8(read(&f.ptx)?).map_err(|_| GpuError::Cache {
                path: f.ptx.clone(),
                detail: "the cached PTX is not text: delete it".into(),
            })?;
            Ok((
                Ptx::from_src(text),
                LoadedImage::PtxJit(arch.into()),
                format!("{why}; cached {}", f.ptx.display()),
            ))
        }
        (choice, _) => {
            let why = match choice {
                ImageChoice::Compile { why } => why,
                _ => "no cache directory".into(),
            };
            let compiled = compile(arch)?;
            if let Some(f) = &files {
                let _ = store(f, &compiled);
            }
            Ok((
                Ptx::from_binary(compiled.cubin),
                LoadedImage::Cubin(arch.into()),
                format!("compiled by NVRTC: {why}"),
            ))
        }
    }
}

/// [`compile_ptx`] through the cache (filled by [`fill_cache`] when it lacks `arch`).
pub fn cached_ptx(arch: &str) -> Result<Ptx> {
    let (files, _) = fill_cache(arch)?;
    let text = std::fs::read_to_string(&files.ptx).map_err(|e| GpuError::Cache {
        path: files.ptx.clone(),
        detail: e.to_string(),
    })?;
    Ok(Ptx::from_src(text))
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SEQPIPE_CACHE") {
        return Some(PathBuf::from(dir).join("ptx"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/seqpipe/ptx"))
}
