//! The `emulate` feature's stand-in for `device`: the same API, with no GPU. Buffers are host
//! allocations addressed by their raw addresses (as device buffers are), kernels run through the
//! CPU emulation of `kernels.cu` (`emu/launcher.cpp`, built by build.rs), and matrix products are
//! plain loops with cuBLAS's row/column conventions. Everything is synchronous. Tests only: it is
//! slow, and exists to run the GPU stage's host code against the CPU stage.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ffi::{CString, c_char, c_void};
use std::marker::PhantomData;
use std::sync::Mutex;
use std::time::Instant;

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

use crate::error::{GpuError, Result, shape};
use crate::profile::{self, OpKind, Profile};
pub use crate::types::Precision;
use crate::types::{Arg, Operands, fits, int, pack};
use crate::types::{AttentionKernels, OperandScratch};

/// A product's `(m, n, k)`, whether `A`/`B` are transposed, and their stored row widths.
type GemmShape = ((usize, usize, usize), (bool, bool), (usize, usize));

unsafe extern "C" {
    fn seqpipe_emu_launch(
        name: *const c_char,
        gx: u32,
        gy: u32,
        gz: u32,
        block: u32,
        params: *mut *mut c_void,
    ) -> i32;
}

/// The emulated kernels share globals (the grid, barriers): one launch at a time per process.
static LAUNCH: Mutex<()> = Mutex::new(());

/// Always present: nothing is loaded.
pub fn libraries_present() -> Result<()> {
    Ok(())
}

/// One emulated device.
pub fn device_count() -> Result<usize> {
    Ok(1)
}

/// A host allocation of `T` addressed like a device buffer.
pub struct Buf<T> {
    ptr: u64,
    len: usize,
    layout: Layout,
    _marker: PhantomData<T>,
}

// SAFETY: the allocation is owned by the buffer and only touched through it or by launches the
// owner makes, as a device buffer is.
unsafe impl<T> Send for Buf<T> {}
unsafe impl<T> Sync for Buf<T> {}

impl<T> Drop for Buf<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `alloc` with this layout.
        unsafe { dealloc(self.ptr as *mut u8, self.layout) };
    }
}

impl<T> Buf<T> {
    fn alloc(n: usize) -> Buf<T> {
        // 256-byte aligned, as cudaMalloc's (kernels with 16-byte loads rely on it).
        let layout = Layout::array::<T>(n.max(1))
            .and_then(|l| l.align_to(256))
            .expect("a buffer size that fits memory");
        // SAFETY: the layout is non-zero-sized.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(
            !ptr.is_null(),
            "out of memory allocating an emulated buffer"
        );
        Buf {
            ptr: ptr as u64,
            len: n.max(1),
            layout,
            _marker: PhantomData,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Address of element `i` (which must be at most `len`).
    pub fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len());
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    pub(crate) fn slice(&self) -> &[T] {
        // SAFETY: `len` initialized elements (zeroed at allocation, then written as `T`).
        unsafe { std::slice::from_raw_parts(self.ptr as *const T, self.len) }
    }
}

/// The emulated GPU.
pub struct Gpu {
    precision: Precision,
    /// Which tensor-core attention kernels BF16 mode launches (`SEQPIPE_ATTENTION`).
    attention: AttentionKernels,
    /// BF16 copies of the products' operands, when BF16 mode rounds them first.
    pub(crate) operands: OperandScratch<Buf<u16>>,
    /// The profiler's state (off unless [`Gpu::profile_begin`]).
    pub(crate) profile: profile::State,
}

impl Gpu {
    /// Opens the emulated device (any ordinal).
    pub fn open(_ordinal: usize, precision: Precision) -> Result<Gpu> {
        Ok(Gpu {
            precision,
            attention: AttentionKernels::from_env()?,
            operands: OperandScratch::default(),
            profile: profile::State::default(),
        })
    }

    /// Runs `f`, an operation of `kind`; when profiling, its wall time is both its GPU and its
    /// host time (everything here is synchronous). Off: `f` alone.
    fn timed<R>(&self, kind: OpKind<'_>, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.profile.on.get() {
            return f();
        }
        let what = self.profile.categorize(kind);
        let started = Instant::now();
        let out = f();
        let took = started.elapsed();
        let launch = matches!(kind, OpKind::Kernel(_) | OpKind::Gemm);
        self.profile.push(what, launch, took, took.as_secs_f64());
        out
    }

    /// `device::Gpu::profile_begin`: starts timing every operation.
    pub fn profile_begin(&self) -> Result<()> {
        self.profile.begin();
        Ok(())
    }

    /// Whether operations are being timed.
    pub fn profiling(&self) -> bool {
        self.profile.on.get()
    }

    /// `device::Gpu::profile_end`: stops timing and sums it over `steps` steps into a [`Profile`]
    /// (the stream's span is the wall time: the emulation has no stream).
    pub fn profile_end(&self, steps: usize) -> Result<Profile> {
        let Some((ops, wall)) = self.profile.end() else {
            return shape("profile_end", "no profile was begun (profile_begin)");
        };
        let wall = wall.as_secs_f64();
        Ok(profile::summarize(
            &ops,
            steps,
            wall,
            wall,
            "wall time of each emulated (synchronous) operation",
        ))
    }

    /// `device::Gpu::profile_scope`.
    pub(crate) fn profile_scope(&self, category: &'static str) -> profile::Scope<'_> {
        self.profile.scope(category)
    }

    /// `device::Gpu::label_products`.
    pub(crate) fn label_products(&self, layer: &str, pass: profile::Pass) {
        self.profile.label_products(layer, pass);
    }

    /// Changes the pass of the products' label (the layer stays).
    pub(crate) fn label_pass(&self, pass: profile::Pass) {
        self.profile.label_pass(pass);
    }

    /// `emulated`.
    pub fn name(&self) -> &str {
        "emulated (CPU)"
    }

    /// `emulated`.
    pub fn arch(&self) -> &'static str {
        "emulated"
    }

    /// No kernel image: the kernels run on the CPU.
    pub fn kernel_image(&self) -> &crate::compile::LoadedImage {
        &crate::compile::LoadedImage::Emulated
    }

    /// How matrix products compute (all FP32 here).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Changes how matrix products compute.
    pub fn set_precision(&mut self, precision: Precision) {
        self.precision = precision;
    }

    /// Which tensor-core attention kernels BF16 mode launches.
    pub fn attention_kernels(&self) -> AttentionKernels {
        self.attention
    }

    /// Changes which tensor-core attention kernels BF16 mode launches (`seqpipe gpu check`
    /// checks both).
    pub fn set_attention_kernels(&mut self, kernels: AttentionKernels) {
        self.attention = kernels;
    }

    /// Whether the attention runs on (emulated) tensor cores: in BF16 mode, as on a GPU of compute
    /// capability 8.0 or later.
    pub fn attention_on_tensor_cores(&self) -> bool {
        self.precision == Precision::Bf16
    }

    /// A nominal 1 TiB free of 1 TiB.
    pub fn memory(&self) -> Result<(usize, usize)> {
        Ok((1 << 40, 1 << 40))
    }

    /// Nothing to bind.
    pub fn bind(&self) -> Result<()> {
        Ok(())
    }

    /// Everything is synchronous.
    pub fn sync(&self) -> Result<()> {
        self.timed(OpKind::Sync, || Ok(()))
    }

    /// A zeroed buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<Buf<T>> {
        self.timed(OpKind::Alloc, || Ok(Buf::alloc(n)))
    }

    /// A buffer holding a copy of `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<Buf<T>> {
        if host.is_empty() {
            return shape("upload", "nothing to upload");
        }
        self.timed(OpKind::Upload, || {
            let b = Buf::<T>::alloc(host.len());
            // SAFETY: `b` holds `host.len()` elements and does not overlap `host`.
            unsafe { std::ptr::copy_nonoverlapping(host.as_ptr(), b.ptr as *mut T, host.len()) };
            Ok(b)
        })
    }

    /// Overwrites `dst` (from its start) with `host`.
    pub fn write<T: DeviceRepr>(&self, dst: &mut Buf<T>, host: &[T]) -> Result<()> {
        fits("write", host.len(), "into", dst.len())?;
        self.timed(OpKind::Upload, || {
            // SAFETY: `dst` holds at least `host.len()` elements and does not overlap `host`.
            unsafe { std::ptr::copy_nonoverlapping(host.as_ptr(), dst.ptr as *mut T, host.len()) };
            Ok(())
        })
    }

    /// A host copy of the buffer.
    pub fn download<T: DeviceRepr + Clone>(&self, buf: &Buf<T>) -> Result<Vec<T>> {
        self.timed(OpKind::Download, || Ok(buf.slice().to_vec()))
    }

    /// A host copy of the first `n` elements of the buffer.
    pub fn download_prefix<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &Buf<T>,
        n: usize,
    ) -> Result<Vec<T>> {
        fits("download", n, "from", buf.len())?;
        self.timed(OpKind::Download, || Ok(buf.slice()[..n].to_vec()))
    }

    /// Sets every element to zero.
    pub fn clear<T: DeviceRepr + ValidAsZeroBits>(&self, buf: &mut Buf<T>) -> Result<()> {
        self.timed(OpKind::Memset, || {
            // SAFETY: the buffer's own allocation; all-zero bytes are a valid `T`.
            unsafe { std::ptr::write_bytes(buf.ptr as *mut T, 0, buf.len) };
            Ok(())
        })
    }

    /// Runs kernel `name` on `grid` × `block` emulated threads with `args`.
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        let mut storage = pack(args);
        let mut params: Vec<*mut c_void> = storage
            .iter_mut()
            .map(|b| b.as_mut_ptr() as *mut c_void)
            .collect();
        let c_name = CString::new(name).expect("kernel names have no NUL");
        let _one = LAUNCH.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the arguments are packed as the kernel's C signature reads them (the wrappers
        // in `kernels` are checked against it), and every address is a live buffer.
        let status = self.timed(OpKind::Kernel(name), || {
            Ok(unsafe {
                seqpipe_emu_launch(
                    c_name.as_ptr(),
                    grid.0,
                    grid.1,
                    grid.2,
                    block,
                    params.as_mut_ptr(),
                )
            })
        })?;
        if status != 0 {
            return Err(GpuError::Shape {
                op: "launch",
                reason: format!("no emulated kernel named {name}"),
            });
        }
        Ok(())
    }

    /// `device::Gpu::gemm_ld_of`: [`Gpu::gemm_of`] with the stored row widths of `A` and `B`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_ld_of(
        &self,
        c: u64,
        a: u64,
        b: u64,
        (m, n, k): (usize, usize, usize),
        (ta, tb): (bool, bool),
        (lda, ldb): (usize, usize),
        beta: f32,
        operands: Operands,
    ) -> Result<()> {
        let (lda_min, ldb_min) = (if ta { m } else { k }, if tb { k } else { n });
        if lda < lda_min || ldb < ldb_min {
            return shape(
                "gemm",
                format!(
                    "rows of {lda} and {ldb} values hold no operands of {lda_min} and {ldb_min}"
                ),
            );
        }
        let dims = ((m, n, k), (ta, tb), (lda, ldb));
        // SAFETY (both): the callers size A and B for these shapes (as for cuBLAS).
        self.timed(OpKind::Gemm, || match operands {
            Operands::F32 => {
                let operand = |p: u64, i: usize| unsafe { *(p as *const f32).add(i) };
                self.gemm_with(c, (a, b), dims, beta, operand)
            }
            Operands::Bf16 => {
                let operand = |p: u64, i: usize| {
                    f32::from_bits((unsafe { *(p as *const u16).add(i) } as u32) << 16)
                };
                self.gemm_with(c, (a, b), dims, beta, operand)
            }
        })
    }

    /// The loops of the products: `operand(base, index)` reads an element of A or B.
    fn gemm_with(
        &self,
        c: u64,
        (a, b): (u64, u64),
        ((m, n, k), (ta, tb), (lda, ldb)): GemmShape,
        beta: f32,
        operand: impl Fn(u64, usize) -> f32,
    ) -> Result<()> {
        const OP: &str = "gemm";
        int(m, OP, "m")?;
        int(n, OP, "n")?;
        int(k, OP, "k")?;
        let c = c as *mut f32;
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for p in 0..k {
                    let x = operand(a, if ta { p * lda + i } else { i * lda + p });
                    let y = operand(b, if tb { j * ldb + p } else { p * ldb + j });
                    acc += x * y;
                }
                // SAFETY: as above.
                unsafe {
                    let dst = c.add(i * n + j);
                    *dst = if beta == 0.0 { acc } else { acc + beta * *dst };
                }
            }
        }
        Ok(())
    }
}
