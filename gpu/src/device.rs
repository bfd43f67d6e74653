//! One GPU opened for a stage: the CUDA context and stream, the compiled kernels, a cuBLAS handle,
//! device buffers, and the launch and matrix-product primitives every kernel wrapper uses.
//!
//! All compute goes to one stream, in order, so no buffer needs event tracking (it is switched off:
//! it would add two events per launch). Buffers are plain `cuMemAlloc` allocations. A second stream
//! only copies state to the host behind the compute ([`crate::offload`]), ordered by explicit events.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::cublas::sys as blas;
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
};

use crate::compile;
use crate::error::{DriverContext, GpuError, Result, shape};
use crate::profile::{self, OpKind, Profile};
pub use crate::types::Precision;
use crate::types::{Arg, Operands, fits, int, pack};
use crate::types::{AttentionKernels, OperandScratch};

/// cuBLAS's compute type for `p`.
fn compute_type(p: Precision) -> blas::cublasComputeType_t {
    match p {
        Precision::Fp32 => blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        Precision::Tf32 => blas::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        Precision::Bf16 => blas::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_16BF,
    }
}

/// Whether the driver, NVRTC and cuBLAS libraries can all be loaded; `Err` names the first that
/// cannot and what to do. cudarc panics on a missing library, so this runs before any CUDA call.
pub fn libraries_present() -> Result<()> {
    // SAFETY: each only tries to dlopen its library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::MissingLibrary {
            what: "driver",
            names: "libcuda.so, libcuda.so.1",
            hint: "this machine has no NVIDIA driver: run on a machine with an NVIDIA GPU, or use model.device = \"cpu\"",
        });
    }
    if !compile::nvrtc_present() {
        return Err(GpuError::MissingLibrary {
            what: "NVRTC",
            names: "libnvrtc.so.13",
            hint: "install CUDA 13's NVRTC (e.g. the nvidia-cuda-nvrtc wheel) and put its lib/ directory on LD_LIBRARY_PATH",
        });
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(GpuError::MissingLibrary {
            what: "cuBLAS",
            names: "libcublas.so.13",
            hint: "install CUDA 13's cuBLAS (e.g. the nvidia-cublas wheel) and put its lib/ directory on LD_LIBRARY_PATH",
        });
    }
    Ok(())
}

/// How many CUDA devices the driver shows (after [`libraries_present`]).
pub fn device_count() -> Result<usize> {
    libraries_present()?;
    let count = CudaContext::device_count().during(|| "counting devices".into())?;
    Ok(count.max(0) as usize)
}

/// A device buffer of `T` with its raw address (kernels take raw addresses; offsets are plain
/// pointer arithmetic in elements through [`Buf::at`]).
pub struct Buf<T> {
    pub(crate) slice: CudaSlice<T>,
    ptr: u64,
}

impl<T> Buf<T> {
    /// Elements held.
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    /// Whether the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Device address of element `i` (which must be at most `len`).
    pub fn at(&self, i: usize) -> u64 {
        debug_assert!(i <= self.len());
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
}

/// An opened GPU.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    copies: Arc<CudaStream>,
    functions: HashMap<String, CudaFunction>,
    blas: blas::cublasHandle_t,
    precision: Precision,
    name: String,
    arch: &'static str,
    /// Compute capability (major, minor).
    capability: (i32, i32),
    /// The kernel image loaded (cubin or PTX JIT).
    image: compile::LoadedImage,
    /// Compute capability 8.0 or later: BF16 `mma.sync` for the attention in BF16 mode.
    bf16_mma: bool,
    /// Which tensor-core attention kernels BF16 mode launches (`SEQPIPE_ATTENTION`).
    attention: AttentionKernels,
    /// BF16 copies of the products' operands, when BF16 mode rounds them first.
    pub(crate) operands: OperandScratch<Buf<u16>>,
    /// The profiler's state (off unless [`Gpu::profile_begin`]).
    pub(crate) profile: profile::State,
    /// Timing events of the profiled operations, two per operation, kept for the next profile.
    events: std::cell::RefCell<Vec<CudaEvent>>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // cuBLAS frees the handle's workspace in the current context: make it this GPU's (the
        // `Gpu` may be dropped on another thread than the one that last used it).
        let _ = self.ctx.bind_to_thread();
        // SAFETY: the handle was created by `open` and is destroyed once.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.blas) };
    }
}

impl Gpu {
    /// Opens device `ordinal`: checks the libraries, creates the context and stream, compiles (or
    /// loads from the cache) the kernels for its compute capability and creates a cuBLAS handle.
    pub fn open(ordinal: usize, precision: Precision) -> Result<Gpu> {
        let attention = AttentionKernels::from_env()?;
        libraries_present()?;
        let count = CudaContext::device_count().during(|| "counting devices".into())?;
        if ordinal as i64 >= count as i64 {
            return Err(GpuError::NoDevice { count, ordinal });
        }
        let ctx = CudaContext::new(ordinal)
            .during(|| format!("creating a context on device {ordinal}"))?;
        // SAFETY: one stream does all the work, in order (module comment).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let copies = ctx
            .new_stream()
            .during(|| "creating the copy stream".into())?;
        let (major, minor) = ctx
            .compute_capability()
            .during(|| "reading the compute capability".into())?;
        if (major, minor) < compile::OLDEST_CAPABILITY {
            let name = ctx.name().unwrap_or_else(|_| format!("device {ordinal}"));
            return Err(GpuError::UnsupportedDevice { name, major, minor });
        }
        let arch = compile::arch_for(major, minor);
        let (image, loaded, source) = compile::kernel_image((major, minor))?;
        let module = ctx
            .load_module(image)
            .during(|| format!("loading the kernels ({loaded}, {source})"))?;
        // Which image a process runs is worth one line: a PTX JIT costs tens of seconds.
        eprintln!("seqpipe gpu: device {ordinal} loaded kernels: {loaded} ({source})");
        let mut functions = HashMap::new();
        let names = compile::KERNELS
            .iter()
            .map(|s| s.to_string())
            .chain(compile::attention_kernels());
        for name in names {
            let f = module
                .load_function(&name)
                .during(|| format!("loading kernel {name}"))?;
            functions.insert(name, f);
        }
        let handle = cudarc::cublas::result::create_handle().map_err(|source| GpuError::Blas {
            during: "creating a handle".into(),
            source,
        })?;
        // SAFETY: the handle is live and the stream belongs to this context.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }.map_err(
            |source| GpuError::Blas {
                during: "binding the stream".into(),
                source,
            },
        )?;
        let name = ctx.name().during(|| "reading the device name".into())?;
        Ok(Gpu {
            ctx,
            stream,
            copies,
            functions,
            blas: handle,
            precision,
            name,
            arch,
            capability: (major, minor),
            image: loaded,
            bf16_mma: (major, minor) >= (8, 0),
            attention,
            operands: OperandScratch::default(),
            profile: profile::State::default(),
            events: Default::default(),
        })
    }

    /// Runs `f`, an operation of `kind` on the compute stream; when profiling, between two timing
    /// events recorded on the stream, its host time measured. Off: `f` alone.
    fn timed<R>(&self, kind: OpKind<'_>, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.profile.on.get() {
            return f();
        }
        let what = self.profile.categorize(kind);
        let i = self.profile.recording.borrow().1.len();
        self.record_event(2 * i)?;
        let started = Instant::now();
        let out = f();
        let host = started.elapsed();
        self.record_event(2 * i + 1)?;
        let launch = matches!(kind, OpKind::Kernel(_) | OpKind::Gemm);
        // The GPU time is read from the events when the profile ends.
        self.profile.push(what, launch, host, 0.0);
        out
    }

    /// Records timing event `i` of the pool (created when first needed) on the compute stream.
    fn record_event(&self, i: usize) -> Result<()> {
        let mut events = self.events.borrow_mut();
        while events.len() <= i {
            let e = self
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .during(|| "creating a profiling event".into())?;
            events.push(e);
        }
        // SAFETY: the event and the stream are live and belong to this context (current: every
        // operation of a stage runs after `bind`).
        unsafe {
            cudarc::driver::result::event::record(events[i].cu_event(), self.stream.cu_stream())
        }
        .during(|| "recording a profiling event".into())
    }

    /// Starts timing every operation on the compute stream (after waiting for the work queued so
    /// far, which is not counted). See [`crate::profile`] for what it measures and costs.
    pub fn profile_begin(&self) -> Result<()> {
        self.sync()?;
        self.profile.begin();
        Ok(())
    }

    /// Whether operations are being timed.
    pub fn profiling(&self) -> bool {
        self.profile.on.get()
    }

    /// Waits for the timed work, stops timing and sums it over `steps` steps into a [`Profile`].
    pub fn profile_end(&self, steps: usize) -> Result<Profile> {
        let synced = self.sync();
        let Some((mut ops, wall)) = self.profile.end() else {
            return shape("profile_end", "no profile was begun (profile_begin)");
        };
        synced?;
        let events = self.events.borrow();
        let ms = |a: usize, b: usize| -> Result<f64> {
            // SAFETY: both events were recorded on the stream, which has completed them.
            let t = unsafe {
                cudarc::driver::result::event::elapsed(events[a].cu_event(), events[b].cu_event())
            }
            .during(|| "reading a profiling event".into())?;
            Ok(t as f64)
        };
        for (i, op) in ops.iter_mut().enumerate() {
            op.gpu_s = ms(2 * i, 2 * i + 1)? / 1e3;
        }
        let span = if ops.is_empty() {
            0.0
        } else {
            ms(0, 2 * ops.len() - 1)? / 1e3
        };
        Ok(profile::summarize(
            &ops,
            steps,
            wall.as_secs_f64(),
            span,
            "cuda events around each operation on the compute stream",
        ))
    }

    /// Counts the kernels launched until the guard drops as `category` (one of [`profile`]'s
    /// scopes) instead of their own.
    pub(crate) fn profile_scope(&self, category: &'static str) -> profile::Scope<'_> {
        self.profile.scope(category)
    }

    /// Names the products issued from now on in the profile (layer `h.3.mlp.c_fc`, or `lm_head`, and pass); a no-op
    /// unless profiling.
    pub(crate) fn label_products(&self, layer: &str, pass: profile::Pass) {
        self.profile.label_products(layer, pass);
    }

    /// Changes the pass of the products' label (the layer stays).
    pub(crate) fn label_pass(&self, pass: profile::Pass) {
        self.profile.label_pass(pass);
    }

    /// The device's name (e.g. `NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The architecture the kernels were compiled for.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Compute capability `(major, minor)`.
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// The kernel image loaded: a cubin of the device's architecture, or PTX the driver compiled.
    pub fn kernel_image(&self) -> &compile::LoadedImage {
        &self.image
    }

    /// How matrix products compute.
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

    /// Whether the attention runs on tensor cores (BF16 mode, compute capability 8.0 or later).
    pub fn attention_on_tensor_cores(&self) -> bool {
        self.precision == Precision::Bf16 && self.bf16_mma
    }

    /// The context.
    pub(crate) fn ctx(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream all compute runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The stream that copies state to the host behind the compute.
    pub(crate) fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copies
    }

    /// `(free, total)` device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().during(|| "reading memory".into())
    }

    /// Makes this GPU's context current on the calling thread (a stage may be driven from
    /// whichever thread of its worker's pool runs the unit).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .during(|| "binding the context to this thread".into())
    }

    /// Waits for all queued work; reports an error any earlier launch left.
    pub fn sync(&self) -> Result<()> {
        self.timed(OpKind::Sync, || {
            self.stream.synchronize().during(|| "synchronizing".into())
        })
    }

    /// A zeroed buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<Buf<T>> {
        let slice = self.timed(OpKind::Alloc, || {
            self.stream
                .alloc_zeros::<T>(n.max(1))
                .during(|| format!("allocating {n} elements"))
        })?;
        Ok(self.wrap(slice))
    }

    /// A buffer holding a copy of `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<Buf<T>> {
        if host.is_empty() {
            return shape("upload", "nothing to upload");
        }
        let slice = self.timed(OpKind::Upload, || {
            self.stream
                .clone_htod(host)
                .during(|| format!("copying {} elements to the device", host.len()))
        })?;
        Ok(self.wrap(slice))
    }

    /// Overwrites `dst` (from its start) with `host`.
    pub fn write<T: DeviceRepr>(&self, dst: &mut Buf<T>, host: &[T]) -> Result<()> {
        fits("write", host.len(), "into", dst.len())?;
        self.timed(OpKind::Upload, || {
            self.stream
                .memcpy_htod(host, &mut dst.slice)
                .during(|| format!("copying {} elements to the device", host.len()))
        })
    }

    /// A host copy of the buffer.
    pub fn download<T: DeviceRepr>(&self, buf: &Buf<T>) -> Result<Vec<T>> {
        self.timed(OpKind::Download, || {
            self.stream
                .clone_dtoh(&buf.slice)
                .during(|| format!("copying {} elements to the host", buf.len()))
        })
    }

    /// A host copy of the first `n` elements of the buffer.
    pub fn download_prefix<T: DeviceRepr + Default + Clone>(
        &self,
        buf: &Buf<T>,
        n: usize,
    ) -> Result<Vec<T>> {
        fits("download", n, "from", buf.len())?;
        let mut out = vec![T::default(); n];
        if n > 0 {
            self.timed(OpKind::Download, || {
                self.stream
                    .memcpy_dtoh(&buf.slice.slice(..n), &mut out)
                    .during(|| format!("copying {n} elements to the host"))
            })?;
        }
        Ok(out)
    }

    /// Sets every element to zero.
    pub fn clear<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        buf: &mut Buf<T>,
    ) -> Result<()> {
        self.timed(OpKind::Memset, || {
            self.stream
                .memset_zeros(&mut buf.slice)
                .during(|| "clearing a buffer".into())
        })
    }

    fn wrap<T>(&self, slice: CudaSlice<T>) -> Buf<T> {
        let ptr = slice.device_ptr(&self.stream).0;
        Buf { slice, ptr }
    }

    /// Launches kernel `name` on `grid` × `block` threads with `args`.
    pub(crate) fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self.functions.get(name).ok_or_else(|| GpuError::Shape {
            op: "launch",
            reason: format!("no kernel named {name}"),
        })?;
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        // The hardware's grid limits: a launch past them would fail with a bare driver error.
        if grid.0 > i32::MAX as u32 || grid.1 > 65_535 || grid.2 > 65_535 {
            return Err(GpuError::Shape {
                op: "launch",
                reason: format!(
                    "kernel {name}: grid {grid:?} exceeds CUDA's limits (x < 2^31, y and z at most 65535); use a smaller batch or fewer heads per stage"
                ),
            });
        }
        // Each argument's bytes live in `storage`; the driver reads them through `params`.
        let mut storage = pack(args);
        let mut params: Vec<*mut c_void> = storage
            .iter_mut()
            .map(|b| b.as_mut_ptr() as *mut c_void)
            .collect();
        self.timed(OpKind::Kernel(name), || {
            // SAFETY: the parameters match the kernel's signature (each wrapper passes them in
            // the order and types of kernels.cu), and every address points into a live buffer.
            unsafe {
                cudarc::driver::result::launch_kernel(
                    f.cu_function(),
                    grid,
                    (block, 1, 1),
                    0,
                    self.stream.cu_stream(),
                    &mut params,
                )
            }
            .during(|| format!("launching {name}"))
        })
    }

    /// [`Gpu::gemm_of`] with the stored row widths of `A` and `B` given (`lda`, `ldb`: at least
    /// the widths the shapes imply; wider rows are skipped past), as the padded LM head's weight
    /// gradient reads `dlogits` rows of the padded vocabulary.
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
        let (operands, compute) = match operands {
            Operands::F32 => (
                blas::cudaDataType_t::CUDA_R_32F,
                compute_type(self.precision),
            ),
            Operands::Bf16 => (
                blas::cudaDataType_t::CUDA_R_16BF,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
        };
        const OP: &str = "gemm";
        let (mi, ni, ki) = (int(m, OP, "m")?, int(n, OP, "n")?, int(k, OP, "k")?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS's "A" is our B.
        let op = |t: bool| {
            if t {
                blas::cublasOperation_t::CUBLAS_OP_T
            } else {
                blas::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // cuBLAS rejects a leading dimension of 0 (even with k = 0, where C is only scaled by
        // beta): a stored width of 0 becomes 1.
        let (lda_min, ldb_min) = (if ta { m } else { k }, if tb { k } else { n });
        if lda < lda_min || ldb < ldb_min {
            return shape(
                OP,
                format!(
                    "rows of {lda} and {ldb} values hold no operands of {lda_min} and {ldb_min}"
                ),
            );
        }
        let ldb = int(ldb, OP, "ldb")?.max(1);
        let lda = int(lda, OP, "lda")?.max(1);
        let alpha = 1.0f32;
        // SAFETY: the addresses point to buffers of at least the sizes the shapes imply (each
        // caller checks them), and the handle is bound to this GPU's stream.
        self.timed(OpKind::Gemm, || unsafe {
            blas::cublasGemmEx(
                self.blas,
                op(tb),
                op(ta),
                ni,
                mi,
                ki,
                &alpha as *const f32 as *const c_void,
                b as *const c_void,
                operands,
                ldb,
                a as *const c_void,
                operands,
                lda,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                blas::cudaDataType_t::CUDA_R_32F,
                ni,
                compute,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
            .map_err(|source| GpuError::Blas {
                during: format!("gemm ({m} x {k}) · ({k} x {n})"),
                source,
            })
        })
    }
}
