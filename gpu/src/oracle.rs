//! Every GPU kernel against its CPU counterpart in `ops` (the oracle), on fresh random inputs:
//! the relative error `‖gpu − cpu‖₂ / ‖cpu‖₂` of each output, per precision where the kernel's
//! arithmetic depends on it. Poisoned outputs (NaN) catch elements a kernel never writes.

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::device::{Gpu, Precision};
use crate::error::{GpuError, Result};
use crate::kernels::{AttnShape, DocStarts, NormSaved, position_doc_starts};
use crate::types::AttentionKernels;

/// One compared output.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Comparison {
    /// Kernel and output, e.g. `attention backward dK (prefix 96)`.
    pub what: String,
    /// Precision of the matrix products (kernels without any report `fp32`).
    pub precision: &'static str,
    /// `‖gpu − cpu‖₂ / ‖cpu‖₂`.
    pub rel_l2: f64,
    /// `max |gpu − cpu| / max |cpu|`.
    pub rel_max: f64,
    /// The bound this precision must meet.
    pub bound: f64,
}

impl Comparison {
    /// Whether the error is within the bound (NaN never is).
    pub fn passed(&self) -> bool {
        self.rel_l2.is_finite() && self.rel_max.is_finite() && self.rel_l2 <= self.bound
    }
}

/// The bound of a precision: FP32 1e-5 (the goal); TF32 and BF16 products round their
/// inputs to 10 and 7 mantissa bits, and their usual errors are ~3e-4 and ~3e-3 (relative L2).
pub fn bound(p: Precision) -> f64 {
    match p {
        Precision::Fp32 => 1e-5,
        Precision::Tf32 => 2e-3,
        Precision::Bf16 => 1.5e-2,
    }
}

fn oracle<T>(r: candle_core::Result<T>) -> Result<T> {
    r.map_err(|e| GpuError::Oracle(e.to_string()))
}

fn ops<T>(r: ops::Result<T>) -> Result<T> {
    r.map_err(|e| GpuError::Oracle(e.to_string()))
}

struct Checker<'a> {
    gpu: &'a mut Gpu,
    rng: ChaCha8Rng,
    out: Vec<Comparison>,
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    oracle(t.flatten_all().and_then(|t| t.to_vec1::<f32>()))
}

impl Checker<'_> {
    fn rand(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| (self.rng.random::<f32>() * 2.0 - 1.0) * scale)
            .collect()
    }

    fn tensor(&mut self, dims: &[usize], scale: f32) -> Result<(Vec<f32>, Tensor)> {
        let v = self.rand(dims.iter().product(), scale);
        let t = oracle(Tensor::from_vec(v.clone(), dims, &Device::Cpu))?;
        Ok((v, t))
    }

    /// A device buffer of `n` NaNs.
    fn poisoned(&self, n: usize) -> Result<crate::Buf<f32>> {
        self.gpu.upload(&vec![f32::NAN; n])
    }

    fn compare(&mut self, what: impl Into<String>, precision: Precision, gpu: &[f32], cpu: &[f32]) {
        let (mut num, mut den, mut max_err, mut max_ref) = (0f64, 0f64, 0f64, 0f64);
        for (&a, &b) in gpu.iter().zip(cpu) {
            let (a, b) = (a as f64, b as f64);
            num += (a - b) * (a - b);
            den += b * b;
            max_err = max_err.max((a - b).abs());
            max_ref = max_ref.max(b.abs());
        }
        let len_ok = gpu.len() == cpu.len();
        let nan = gpu.iter().any(|x| !x.is_finite());
        let rel = |n: f64, d: f64| {
            if !len_ok || nan {
                f64::NAN
            } else if d == 0.0 {
                n
            } else {
                n / d
            }
        };
        self.out.push(Comparison {
            what: what.into(),
            precision: precision.name(),
            rel_l2: rel(num.sqrt(), den.sqrt()),
            rel_max: rel(max_err, max_ref),
            bound: bound(precision),
        });
    }
}

/// Which kernels a check runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// Every kernel.
    All,
    /// The attention kernels only (FP32 and, from compute capability 8.0, BF16 tensor cores):
    /// what `scripts/gpu-check.sh` runs under compute-sanitizer's racecheck, whose shared-memory
    /// tracking is too slow for the whole set.
    Attention,
}

/// Runs every kernel check; the GPU's precision and attention kernels are restored afterwards.
pub fn check_all(gpu: &mut Gpu, seed: u64) -> Result<Vec<Comparison>> {
    check(gpu, seed, Kernels::All)
}

/// Runs the checks of `which` kernels; the GPU's precision and attention kernels are restored afterwards.
pub fn check(gpu: &mut Gpu, seed: u64, which: Kernels) -> Result<Vec<Comparison>> {
    let saved = (gpu.precision(), gpu.attention_kernels());
    let mut c = Checker {
        gpu,
        rng: ChaCha8Rng::seed_from_u64(seed),
        out: Vec::new(),
    };
    let all = which == Kernels::All;
    let result = (|| {
        if all {
            for p in Precision::ALL {
                c.gpu.set_precision(p);
                linear(&mut c, p)?;
                lm_head(&mut c, p)?;
            }
            c.gpu.set_precision(Precision::Fp32);
            norms(&mut c)?;
            gelu(&mut c)?;
        }
        c.gpu.set_precision(Precision::Fp32);
        for (d, s, p) in [
            (64, 128, 0),
            (64, 96, 160),
            (32, 70, 33),
            (128, 64, 64),
            (16, 50, 0),
        ] {
            attention(&mut c, d, s, p, 0, false)?;
        }
        // As the pipeline stage calls it: K/V in a cache of whole sequences (rows past the prefix
        // and segment hold other data), dK/dV added to an accumulator.
        attention(&mut c, 64, 40, 30, 25, false)?;
        // Document masks ([`masked_layout`]: documents spanning the prefix boundary, one starting
        // on it, one-token documents), against ops::document_prefix_attention_*.
        for (d, s, p, extra) in MASKED {
            attention(&mut c, d, s, p, extra, true)?;
        }
        // BF16 mode's attention on tensor cores (compute capability 8.0 and later), both
        // versions of its kernels; v2 also at a segment of two 128-query forward blocks, the
        // second a tail.
        c.gpu.set_precision(Precision::Bf16);
        if c.gpu.attention_on_tensor_cores() {
            for version in AttentionKernels::ALL {
                c.gpu.set_attention_kernels(version);
                for (d, s, p) in [(64, 128, 0), (64, 96, 160), (32, 70, 33), (128, 64, 64)] {
                    attention(&mut c, d, s, p, 0, false)?;
                }
                attention(&mut c, 64, 40, 30, 25, false)?;
                if version == AttentionKernels::V2 {
                    attention(&mut c, 64, 200, 57, 0, false)?;
                    // v1 takes no document starts (it refuses them): masks are v2's.
                    for (d, s, p, extra) in MASKED {
                        attention(&mut c, d, s, p, extra, true)?;
                    }
                }
            }
        }
        c.gpu.set_precision(Precision::Fp32);
        if all {
            embedding(&mut c)?;
            rope(&mut c)?;
            adamw_and_norm(&mut c)?;
        }
        Ok(())
    })();
    c.gpu.set_precision(saved.0);
    c.gpu.set_attention_kernels(saved.1);
    result.map(|()| c.out)
}

fn linear(c: &mut Checker, p: Precision) -> Result<()> {
    let (n, d_in, d_out) = (300, 192, 320);
    let (xv, x) = c.tensor(&[n, d_in], 1.0)?;
    let (wv, w) = c.tensor(&[d_out, d_in], 0.1)?;
    let (bv, b) = c.tensor(&[d_out], 0.1)?;
    let (dyv, dy) = c.tensor(&[n, d_out], 1.0)?;
    let (y, ctx) = ops(ops::linear_forward(&x, &w, Some(&b)))?;
    let (dx, g) = ops(ops::linear_backward(&ctx, &w, &dy, true))?;
    let gpu = &*c.gpu;
    let (xd, wd, bd, dyd) = (
        gpu.upload(&xv)?,
        gpu.upload(&wv)?,
        gpu.upload(&bv)?,
        gpu.upload(&dyv)?,
    );
    let yd = c.poisoned(n * d_out)?;
    let dxd = c.poisoned(n * d_in)?;
    let dwd = gpu.zeros::<f32>(d_out * d_in)?;
    let dbd = gpu.zeros::<f32>(d_out)?;
    let scratch = gpu.zeros::<f32>(Gpu::column_scratch_len(n, d_out))?;
    gpu.linear_forward(yd.ptr(), xd.ptr(), wd.ptr(), bd.ptr(), n, d_in, d_out)?;
    gpu.linear_backward(
        (dxd.ptr(), dwd.ptr(), dbd.ptr()),
        dyd.ptr(),
        (xd.ptr(), wd.ptr()),
        (n, d_in, d_out),
        &scratch,
    )?;
    let got = [
        gpu.download(&yd)?,
        gpu.download(&dxd)?,
        gpu.download(&dwd)?,
        gpu.download(&dbd)?,
    ];
    let want = [
        host(&y)?,
        host(&dx)?,
        host(&g.dw)?,
        host(g.db.as_ref().expect("bias"))?,
    ];
    for (name, (a, b)) in [
        "linear forward y",
        "linear backward dx",
        "linear backward dW",
        "linear backward db",
    ]
    .iter()
    .zip(got.iter().zip(&want))
    {
        let prec = if name.ends_with("db") {
            Precision::Fp32
        } else {
            p
        };
        c.compare(*name, prec, a, b);
    }
    Ok(())
}

fn lm_head(c: &mut Checker, p: Precision) -> Result<()> {
    let (n, ch, v) = (200, 96, 1000);
    let (hv, h) = c.tensor(&[n, ch], 1.0)?;
    let (wv, w) = c.tensor(&[v, ch], 0.2)?;
    let tv: Vec<u32> = (0..n).map(|_| c.rng.random_range(0..v as u32)).collect();
    let t = oracle(Tensor::from_vec(tv.clone(), n, &Device::Cpu))?;
    let scale = 1.0 / n as f64;
    let (loss, g) = ops(ops::lm_head_loss_forward_backward(&h, &w, &t, scale, 64))?;
    let gpu = &*c.gpu;
    let (hd, wd, td) = (gpu.upload(&hv)?, gpu.upload(&wv)?, gpu.upload(&tv)?);
    let chunk = 64;
    let logits = gpu.zeros::<f32>(chunk * v)?;
    let losses = c.poisoned(n)?;
    let dh = c.poisoned(n * ch)?;
    let dw = gpu.zeros::<f32>(v * ch)?;
    for r0 in (0..n).step_by(chunk) {
        let rows = chunk.min(n - r0);
        gpu.gemm(
            logits.ptr(),
            hd.at(r0 * ch),
            wd.ptr(),
            (rows, v, ch),
            false,
            true,
            0.0,
        )?;
        gpu.softmax_cross_entropy(
            logits.ptr(),
            losses.at(r0),
            td.at(r0),
            rows,
            v,
            scale as f32,
            true,
        )?;
        gpu.gemm(
            dh.at(r0 * ch),
            logits.ptr(),
            wd.ptr(),
            (rows, ch, v),
            false,
            false,
            0.0,
        )?;
        gpu.gemm(
            dw.ptr(),
            logits.ptr(),
            hd.at(r0 * ch),
            (v, ch, rows),
            true,
            false,
            1.0,
        )?;
    }
    let gl: f64 = gpu.download(&losses)?.iter().map(|&x| x as f64).sum();
    let (dh, dw) = (gpu.download(&dh)?, gpu.download(&dw)?);
    c.compare(
        "lm head + cross-entropy loss",
        p,
        &[gl as f32],
        &[loss as f32],
    );
    let (a, b) = (dh, host(&g.dh)?);
    c.compare("lm head + cross-entropy dh", p, &a, &b);
    let (a, b) = (dw, host(&g.dw)?);
    c.compare("lm head + cross-entropy dW", p, &a, &b);
    Ok(())
}

fn norms(c: &mut Checker) -> Result<()> {
    let (n, ch) = (257, 384);
    for rms in [false, true] {
        let (xv, x) = c.tensor(&[n, ch], 2.0)?;
        let (wv, w) = c.tensor(&[ch], 1.0)?;
        let (bv, b) = c.tensor(&[ch], 1.0)?;
        let (dyv, dy) = c.tensor(&[n, ch], 1.0)?;
        let eps = 1e-5;
        let (y, (dx, g)) = if rms {
            let (y, ctx) = ops(ops::rms_norm_forward(&x, &w, eps))?;
            (y, ops(ops::rms_norm_backward(&ctx, &w, &dy))?)
        } else {
            let (y, ctx) = ops(ops::layer_norm_forward(&x, &w, Some(&b), eps))?;
            (y, ops(ops::layer_norm_backward(&ctx, &w, &dy, true))?)
        };
        let gpu = &*c.gpu;
        let (xd, wd, bd, dyd) = (
            gpu.upload(&xv)?,
            gpu.upload(&wv)?,
            gpu.upload(&bv)?,
            gpu.upload(&dyv)?,
        );
        let (yd, mean, rstd, dxd) = (
            c.poisoned(n * ch)?,
            gpu.zeros::<f32>(n)?,
            gpu.zeros::<f32>(n)?,
            c.poisoned(n * ch)?,
        );
        let (dwd, dbd) = (gpu.zeros::<f32>(ch)?, gpu.zeros::<f32>(ch)?);
        let scratch = gpu.zeros::<f32>(2 * Gpu::column_scratch_len(n, ch))?;
        let bptr = if rms { 0 } else { bd.ptr() };
        let saved = NormSaved {
            x: xd.ptr(),
            mean: mean.ptr(),
            rstd: rstd.ptr(),
            n,
            c: ch,
            rms,
        };
        gpu.norm_forward(yd.ptr(), (wd.ptr(), bptr), &saved, eps as f32)?;
        gpu.norm_backward(
            dxd.ptr(),
            (dwd.ptr(), if rms { 0 } else { dbd.ptr() }),
            dyd.ptr(),
            wd.ptr(),
            &saved,
            &scratch,
        )?;
        let kind = if rms { "rms norm" } else { "layer norm" };
        let (a, b) = (gpu.download(&yd)?, host(&y)?);
        c.compare(format!("{kind} forward"), Precision::Fp32, &a, &b);
        let (a, b) = (c.gpu.download(&dxd)?, host(&dx)?);
        c.compare(format!("{kind} backward dx"), Precision::Fp32, &a, &b);
        let (a, b) = (c.gpu.download(&dwd)?, host(&g.dweight)?);
        c.compare(format!("{kind} backward dweight"), Precision::Fp32, &a, &b);
        if let Some(db) = &g.dbias {
            let (a, b) = (c.gpu.download(&dbd)?, host(db)?);
            c.compare(format!("{kind} backward dbias"), Precision::Fp32, &a, &b);
        }
    }
    Ok(())
}

fn gelu(c: &mut Checker) -> Result<()> {
    let (n, f) = (129, 768);
    let (xv, x) = c.tensor(&[n, f], 4.0)?;
    let (bv, b) = c.tensor(&[f], 1.0)?;
    let (dyv, dy) = c.tensor(&[n, f], 1.0)?;
    let (y, ctx) = ops(ops::gelu_forward(&x, Some(&b)))?;
    let (dx, db) = ops(ops::gelu_backward(&ctx, &dy))?;
    let gpu = &*c.gpu;
    let (ud, bd, dyd) = (gpu.upload(&xv)?, gpu.upload(&bv)?, gpu.upload(&dyv)?);
    let (yd, dud) = (c.poisoned(n * f)?, c.poisoned(n * f)?);
    let dbd = gpu.zeros::<f32>(f)?;
    let scratch = gpu.zeros::<f32>(Gpu::column_scratch_len(n, f))?;
    gpu.bias_gelu_forward(yd.ptr(), ud.ptr(), bd.ptr(), n, f)?;
    gpu.gelu_backward(dud.ptr(), dyd.ptr(), ud.ptr(), n * f)?;
    gpu.column_sum(dbd.ptr(), dud.ptr(), n, f, false, &scratch)?;
    let (a, b) = (gpu.download(&yd)?, host(&y)?);
    c.compare("bias + gelu forward", Precision::Fp32, &a, &b);
    let (a, b) = (c.gpu.download(&dud)?, host(&dx)?);
    c.compare("bias + gelu backward dx", Precision::Fp32, &a, &b);
    let (a, b) = (c.gpu.download(&dbd)?, host(db.as_ref().expect("bias"))?);
    c.compare("bias + gelu backward dbias", Precision::Fp32, &a, &b);
    Ok(())
}

/// `(B, L, H, D)` token-major rows (the GPU layout) from `(B, H, L, D)`.
fn to_rows(x: &[f32], b: usize, h: usize, l: usize, d: usize) -> Vec<f32> {
    let mut out = vec![0.0; x.len()];
    for bi in 0..b {
        for hi in 0..h {
            for li in 0..l {
                let src = ((bi * h + hi) * l + li) * d;
                let dst = ((bi * l + li) * h + hi) * d;
                out[dst..dst + d].copy_from_slice(&x[src..src + d]);
            }
        }
    }
    out
}

/// `rows` (B·l rows of `width`) spread over groups of `l + extra` rows, the extra rows `fill`.
fn pad_rows(rows: &[f32], b: usize, l: usize, extra: usize, width: usize, fill: f32) -> Vec<f32> {
    let mut out = vec![fill; b * (l + extra) * width];
    for bi in 0..b {
        let (src, dst) = (bi * l * width, bi * (l + extra) * width);
        out[dst..dst + l * width].copy_from_slice(&rows[src..src + l * width]);
    }
    out
}

/// What the dK/dV accumulators hold before a cached attention's backward adds to them (exact in
/// binary, so subtracting it back loses nothing of the gradient's precision above its ulp).
const PRIOR: f32 = 0.5;

/// A dK or dV of `l` rows per sequence (rows of `width`) against the CPU's `want`. With `extra >
/// 0` the GPU's accumulator has `l + extra` rows per sequence and started at [`PRIOR`]: the used
/// rows must hold PRIOR + the gradient, the unused ones PRIOR still.
fn compare_kv_grad(
    c: &mut Checker,
    what: &str,
    precision: Precision,
    a: &[f32],
    want: &[f32],
    (l, extra, width): (usize, usize, usize),
) -> Result<()> {
    if extra == 0 {
        c.compare(what, precision, a, want);
        return Ok(());
    }
    let (mut used, mut unused) = (Vec::new(), Vec::new());
    for (r, row) in a.chunks(width).enumerate() {
        if r % (l + extra) < l {
            used.extend(row.iter().map(|x| x - PRIOR));
        } else {
            unused.extend_from_slice(row);
        }
    }
    c.compare(what, precision, &used, want);
    let prior = vec![PRIOR; unused.len()];
    c.compare(
        format!("{what}: rows past the segment untouched"),
        Precision::Fp32,
        &unused,
        &prior,
    );
    Ok(())
}

/// The document-masked attention checks: `(D, segment, prefix, extra cache rows)`. Two 128-query
/// blocks (v2's forward) in the second; a K/V cache with dK/dV added in the third.
const MASKED: [(usize, usize, usize, usize); 3] =
    [(64, 96, 160, 0), (64, 200, 57, 0), (64, 40, 30, 25)];

/// Document starts of two sequences of `l` positions whose last `s` are the segment's queries
/// (prefix `p = l - s`): the first has a one-token document early on, a document spanning the
/// prefix boundary and one starting mid-segment; the second a document starting exactly at the
/// segment's first query, a one-token document right after it, and one starting on its last
/// query. Starts at or past `l` are dropped.
pub fn masked_layout(p: usize, s: usize) -> Result<ops::DocumentMask> {
    let l = p + s;
    let row = |starts: &[usize]| {
        let mut v: Vec<usize> = starts.iter().copied().filter(|&x| x < l).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let a = row(&[0, p / 4, p / 4 + 1, p.saturating_sub(10), p + s / 2]);
    let b = row(&[0, p, p + 1, l - 1]);
    ops::DocumentMask::new(vec![a, b]).map_err(|e| GpuError::Oracle(e.to_string()))
}

/// Causal prefix attention against the CPU's. With `extra > 0` the keys and values sit in a cache
/// of `p + s + extra` rows per sequence and dK/dV are added to accumulators holding [`PRIOR`].
/// With `masked`, each query sees only its own document's keys ([`masked_layout`]), against
/// `ops::document_prefix_attention_*`.
/// In BF16 mode on tensor cores, the BF16 bound applies, and the rows name the kernels' version
/// (`v1`, `v2`); the v2 kernels also run a second time on the same inputs, and every output of
/// the two runs must be bit-identical (the project's determinism, checked on the GPU itself).
fn attention(
    c: &mut Checker,
    d: usize,
    s: usize,
    p: usize,
    extra: usize,
    masked: bool,
) -> Result<()> {
    let tensor_cores = c.gpu.attention_on_tensor_cores();
    let precision = if tensor_cores {
        Precision::Bf16
    } else {
        Precision::Fp32
    };
    let version = c.gpu.attention_kernels();
    let (b, h) = (2, 3);
    let l = p + s;
    let (qv, q) = c.tensor(&[b, h, s, d], 1.0)?;
    let (kv, k) = c.tensor(&[b, h, l, d], 1.0)?;
    let (vv, v) = c.tensor(&[b, h, l, d], 1.0)?;
    let (dyv, dy) = c.tensor(&[b, h, s, d], 1.0)?;
    let scale = 1.0 / (d as f64).sqrt();
    let mask = if masked {
        masked_layout(p, s)?
    } else {
        ops::DocumentMask::single(b)
    };
    // The unmasked kernels are the masked ones with one document per sequence, bit for bit.
    let (y, ctx) = ops(ops::document_prefix_attention_forward(
        &q, &k, &v, scale, &mask, 0,
    ))?;
    let (dq, dk, dv) = ops(ops::document_prefix_attention_backward(
        &ctx, &k, &v, &dy, scale, &mask, 0,
    ))?;
    let cached = extra > 0;
    let rows = l + extra;
    let starts = position_doc_starts(&mask, rows);
    let starts_dev = c.gpu.upload(&starts)?;
    let docs = masked.then_some(DocStarts {
        ptr: starts_dev.ptr(),
        len: starts.len(),
    });
    // Junk in the cache's unused rows (finite: a kernel that reads them shows up as an error).
    let kv_rows = |x: &[f32]| pad_rows(&to_rows(x, b, h, l, d), b, l, extra, h * d, 7.0);
    let gpu = &*c.gpu;
    let qd = gpu.upload(&to_rows(&qv, b, h, s, d))?;
    let kd = gpu.upload(&kv_rows(&kv))?;
    let vd = gpu.upload(&kv_rows(&vv))?;
    let dyd = gpu.upload(&to_rows(&dyv, b, h, s, d))?;
    let sh = AttnShape {
        b,
        h,
        d,
        s,
        p,
        q_stride: h * d,
        kv_stride: h * d,
        kv_rows: rows,
    };
    let inputs = AttnInputs {
        q: &qd,
        k: &kd,
        v: &vd,
        dy: &dyd,
        docs,
        sh,
        scale: scale as f32,
        cached,
    };
    let got = inputs.run(c)?;
    let tag = attention_tag(
        &sh,
        tensor_cores.then_some(version),
        masked.then_some(&mask),
    );
    let [gy, glse, gdq, gdk, gdv] = &got;
    for (name, got, want) in [("forward y", gy, &y), ("backward dQ", gdq, &dq)] {
        let b_ = to_rows(&host(want)?, b, h, s, d);
        c.compare(format!("attention {name} {tag}"), precision, got, &b_);
    }
    for (name, got, want) in [("backward dK", gdk, &dk), ("backward dV", gdv, &dv)] {
        let want = to_rows(&host(want)?, b, h, l, d);
        compare_kv_grad(
            c,
            &format!("attention {name} {tag}"),
            precision,
            got,
            &want,
            (l, extra, h * d),
        )?;
    }
    let b_ = host(&ctx.lse)?;
    c.compare(format!("attention forward lse {tag}"), precision, glse, &b_);
    if tensor_cores && version == AttentionKernels::V2 {
        let again = inputs.run(c)?;
        let what = format!("attention run twice, outputs bit-identical {tag}");
        push_bit_identical(c, &what, precision, &got, &again);
    }
    Ok(())
}

/// The device inputs of one attention check (see [`attention`]).
struct AttnInputs<'a> {
    q: &'a crate::Buf<f32>,
    k: &'a crate::Buf<f32>,
    v: &'a crate::Buf<f32>,
    dy: &'a crate::Buf<f32>,
    docs: Option<DocStarts>,
    sh: AttnShape,
    scale: f32,
    /// dK/dV add to accumulators holding [`PRIOR`] in a cache of `sh.kv_rows` rows.
    cached: bool,
}

impl AttnInputs<'_> {
    /// Forward and backward into fresh outputs (poisoned, or PRIOR where dK/dV accumulate):
    /// y, lse, dQ, dK, dV as they come back.
    fn run(&self, c: &Checker) -> Result<[Vec<f32>; 5]> {
        let gpu = &*c.gpu;
        let AttnShape { b, h, d, s, p, .. } = self.sh;
        let (l, rows) = (p + s, self.sh.kv_rows);
        let (yd, lse, delta) = (
            c.poisoned(b * s * h * d)?,
            c.poisoned(b * h * s)?,
            gpu.zeros::<f32>(b * h * s)?,
        );
        let dqd = c.poisoned(b * s * h * d)?;
        let (dkd, dvd) = if self.cached {
            let prior = vec![PRIOR; b * rows * h * d];
            (gpu.upload(&prior)?, gpu.upload(&prior)?)
        } else {
            (c.poisoned(b * l * h * d)?, c.poisoned(b * l * h * d)?)
        };
        let (q, k, v) = (self.q.ptr(), self.k.ptr(), self.v.ptr());
        gpu.attention_forward(yd.ptr(), lse.ptr(), q, k, v, self.docs, self.sh, self.scale)?;
        gpu.attention_backward(
            dqd.ptr(),
            dkd.ptr(),
            dvd.ptr(),
            q,
            k,
            v,
            yd.ptr(),
            self.dy.ptr(),
            lse.ptr(),
            delta.ptr(),
            self.docs,
            self.sh,
            self.scale,
            self.cached,
        )?;
        Ok([
            gpu.download(&yd)?,
            gpu.download(&lse)?,
            gpu.download(&dqd)?,
            gpu.download(&dkd)?,
            gpu.download(&dvd)?,
        ])
    }
}

/// The name of an attention check's rows: its shape, the tensor-core kernels' version (when on
/// tensor cores) and the documents of each sequence (when masked).
fn attention_tag(
    sh: &AttnShape,
    version: Option<AttentionKernels>,
    mask: Option<&ops::DocumentMask>,
) -> String {
    let AttnShape { b, d, s, p, .. } = *sh;
    let kernels = version.map_or(String::new(), |v| format!(", tensor cores {}", v.name()));
    let documents = mask.map_or(String::new(), |mask| {
        let counts: Vec<usize> = (0..b).map(|r| mask.starts(r).len()).collect();
        format!(", document masks of {counts:?} documents")
    });
    let rows = sh.kv_rows;
    if rows > p + s {
        format!(
            "(D {d}, segment {s}, prefix {p}, cache of {rows} rows, dK/dV added{kernels}{documents})"
        )
    } else {
        format!("(D {d}, segment {s}, prefix {p}{kernels}{documents})")
    }
}

/// A row saying how many of `got`'s values differ bit-wise from `again`'s (bound 0).
fn push_bit_identical(
    c: &mut Checker,
    what: &str,
    precision: Precision,
    got: &[Vec<f32>],
    again: &[Vec<f32>],
) {
    let differ: usize = got
        .iter()
        .zip(again)
        .map(|(a, b)| {
            a.iter()
                .zip(b)
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count()
        })
        .sum();
    let total: usize = got.iter().map(Vec::len).sum();
    c.out.push(Comparison {
        what: format!("{what}: {differ} of {total} differ"),
        precision: precision.name(),
        rel_l2: differ as f64,
        rel_max: differ as f64,
        bound: 0.0,
    });
}

fn embedding(c: &mut Checker) -> Result<()> {
    let (v, ch, b, t) = (500, 64, 3, 40);
    let n = b * t;
    let (wv, w) = c.tensor(&[v, ch], 1.0)?;
    let (pv, pos) = c.tensor(&[t, ch], 1.0)?;
    // Repeated ids exercise the ordered sums of the table gradient.
    let ids: Vec<u32> = (0..n).map(|_| c.rng.random_range(0..50u32)).collect();
    let idt = oracle(Tensor::from_vec(ids.clone(), n, &Device::Cpu))?;
    let (dyv, dy) = c.tensor(&[n, ch], 1.0)?;
    let tok = ops(ops::embedding_forward(&idt, &w))?;
    let y = oracle(
        tok.reshape((b, t, ch))
            .and_then(|x| x.broadcast_add(&pos))
            .and_then(|x| x.reshape((n, ch))),
    )?;
    let dw = ops(ops::embedding_backward(&idt, &dy, v))?;
    let dpos = oracle(dy.reshape((b, t, ch)).and_then(|x| x.sum(0)))?;
    let gpu = &*c.gpu;
    let (wd, pd, idd, dyd) = (
        gpu.upload(&wv)?,
        gpu.upload(&pv)?,
        gpu.upload(&ids)?,
        gpu.upload(&dyv)?,
    );
    let yd = c.poisoned(n * ch)?;
    let (dwd, dpd) = (gpu.zeros::<f32>(v * ch)?, gpu.zeros::<f32>(t * ch)?);
    gpu.embed_forward(yd.ptr(), idd.ptr(), wd.ptr(), pd.ptr(), n, ch, (t, 0), None)?;
    gpu.embed_backward_tokens(dwd.ptr(), dyd.ptr(), &ids, ch)?;
    gpu.embed_backward_positions(dpd.ptr(), dyd.ptr(), b, t, ch, 0)?;
    let (a, b_) = (gpu.download(&yd)?, host(&y)?);
    c.compare("embedding forward", Precision::Fp32, &a, &b_);
    let (a, b_) = (c.gpu.download(&dwd)?, host(&dw)?);
    c.compare("embedding backward dwte", Precision::Fp32, &a, &b_);
    let (a, b_) = (c.gpu.download(&dpd)?, host(&dpos)?);
    c.compare("embedding backward dwpe", Precision::Fp32, &a, &b_);
    reset_positions(c)
}

/// The position embedding when positions restart at each document (`data.reset_positions`): a
/// segment (positions 12..40 of 40, three rows) whose documents start before it, inside it, on
/// its first position and on its last, against `ops::embedding_forward`/`_backward` of the CPU's
/// position ids (`model::documents::position_ids`).
fn reset_positions(c: &mut Checker) -> Result<()> {
    let (ch, seq, pos0, t) = (64, 40, 12, 28);
    let rows = vec![vec![0, 5, 20, 21], vec![0], vec![0, 12, 39]];
    let b = rows.len();
    let mask = ops::DocumentMask::new(rows).map_err(|e| GpuError::Oracle(e.to_string()))?;
    let n = b * t;
    let pos_ids = model::documents::position_ids(Some(&mask), b, pos0, t, true);
    let ids = pos_ids.iter().map(|&q| q as usize).max().unwrap_or(0) + 1;
    let (pv, pos) = c.tensor(&[seq, ch], 1.0)?;
    let (dyv, dy) = c.tensor(&[n, ch], 1.0)?;
    let pid = oracle(Tensor::from_vec(pos_ids, n, &Device::Cpu))?;
    let y = ops(ops::embedding_forward(&pid, &pos))?;
    let dpos = ops(ops::embedding_backward(&pid, &dy, seq))?;
    let gpu = &*c.gpu;
    let starts = gpu.upload(&position_doc_starts(&mask, seq))?;
    let docs = DocStarts {
        ptr: starts.ptr(),
        len: starts.len(),
    };
    // Token table of zeros: the output is the position rows alone.
    let (pd, dyd, wd, idd) = (
        gpu.upload(&pv)?,
        gpu.upload(&dyv)?,
        gpu.zeros::<f32>(ch)?,
        gpu.zeros::<u32>(n)?,
    );
    let yd = c.poisoned(n * ch)?;
    let dpd = gpu.zeros::<f32>(seq * ch)?;
    let shape = (b, t, ch, pos0);
    gpu.embed_forward(
        yd.ptr(),
        idd.ptr(),
        wd.ptr(),
        pd.ptr(),
        n,
        ch,
        (t, pos0),
        Some((docs, seq)),
    )?;
    gpu.embed_backward_positions_reset(dpd.ptr(), dyd.ptr(), shape, docs, seq, ids)?;
    let (a, b_) = (gpu.download(&yd)?, host(&y)?);
    c.compare(
        "embedding forward, positions restarting at documents",
        Precision::Fp32,
        &a,
        &b_,
    );
    let (a, b_) = (c.gpu.download(&dpd)?, host(&dpos)?);
    c.compare(
        "embedding backward dwpe, positions restarting at documents",
        Precision::Fp32,
        &a,
        &b_,
    );
    Ok(())
}

fn rope(c: &mut Checker) -> Result<()> {
    let (b, h, s, d, offset, max_len) = (2, 3, 20, 32, 7, 64);
    let table = ops(ops::RopeTable::new(
        max_len,
        d,
        10_000.0,
        candle_core::DType::F32,
        &Device::Cpu,
    ))?;
    let (xv, x) = c.tensor(&[b, h, s, d], 1.0)?;
    let fwd = ops(table.forward(&x, offset))?;
    let bwd = ops(table.backward(&x, offset))?;
    let (cos, sin) = (
        c.gpu.upload(&host(table.cos())?)?,
        c.gpu.upload(&host(table.sin())?)?,
    );
    for (inverse, want, name) in [(false, &fwd, "rope forward"), (true, &bwd, "rope backward")] {
        let gpu = &*c.gpu;
        let xd = gpu.upload(&to_rows(&xv, b, h, s, d))?;
        gpu.rope(
            xd.ptr(),
            cos.ptr(),
            sin.ptr(),
            (b, s, h, d),
            h * d,
            offset,
            inverse,
        )?;
        let a = gpu.download(&xd)?;
        let b_ = to_rows(&host(want)?, b, h, s, d);
        c.compare(name, Precision::Fp32, &a, &b_);
    }
    Ok(())
}

fn adamw_and_norm(c: &mut Checker) -> Result<()> {
    let n = 10_007;
    let (pv, p) = c.tensor(&[n], 1.0)?;
    let (gv, g) = c.tensor(&[n], 0.1)?;
    let mut opt = ops::AdamW::new(ops::AdamWConfig::default());
    let (lr, wd, clip) = (1e-3, 0.1, 0.7);
    let gpu = &*c.gpu;
    let (pd, md, vd, gd) = (
        gpu.upload(&pv)?,
        gpu.zeros::<f32>(n)?,
        gpu.zeros::<f32>(n)?,
        gpu.upload(&gv)?,
    );
    let mut param = p;
    for t in 1..=3u64 {
        opt.begin_step();
        param = ops(opt.update("p", &param, &g, clip, lr, wd))?;
        let cfg = &opt.config;
        let (b1, b2) = (cfg.beta1, cfg.beta2);
        let inv_bc2 = 1.0 / (1.0 - b2.powf(t as f64));
        let lr_bc1 = lr / (1.0 - b1.powf(t as f64));
        gpu.adamw(
            pd.ptr(),
            md.ptr(),
            vd.ptr(),
            gd.ptr(),
            n,
            clip as f32,
            (b1, b2, cfg.eps),
            (inv_bc2 as f32, lr_bc1 as f32, (1.0 - lr * wd) as f32),
        )?;
    }
    let (a, b) = (gpu.download(&pd)?, host(&param)?);
    c.compare("adamw (3 steps) parameters", Precision::Fp32, &a, &b);
    let m = &opt.moments["p"];
    let (a, b) = (c.gpu.download(&vd)?, host(&m.v)?);
    c.compare("adamw (3 steps) second moment", Precision::Fp32, &a, &b);
    let want = ops(ops::sum_of_squares(&g))?;
    let got = c.gpu.sums_of_squares(&[(gd.ptr(), n)])?[0];
    c.compare(
        "sum of squares",
        Precision::Fp32,
        &[got as f32],
        &[want as f32],
    );
    Ok(())
}
