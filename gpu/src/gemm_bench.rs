//! The matrix products of a GPT's training step, timed side by side in the ways BF16 mode could
//! feed cuBLAS: FP32 operands with `CUBLAS_COMPUTE_32F_FAST_16BF` (cuBLAS rounds the operands
//! itself), BF16 operands already rounded, and BF16 operands rounded first by
//! [`Gpu::to_bf16`] (what keeping BF16 copies would cost where they are not kept), and BF16 mode's
//! default, the stage's fast path: weights from cached BF16 copies (rounded outside the timing, as
//! the stage does once per update), the activation operand rounded in the timing where the stage
//! rounds it, and the LM head over the vocabulary padded to a multiple of
//! [`crate::stage::VOCAB_PADDING`]; with TF32 and FP32 beside. `seqpipe gpu gemm` prints them; the
//! GPU check runs it.
//!
//! The shapes are one block's linear layers (forward, input gradient, weight gradient, as the
//! stage calls them) and one chunk of the LM head, for `rows` rows of a `d_model`-wide model.

use std::time::Instant;

use serde::Serialize;

use crate::device::{Buf, Gpu, Precision};
use crate::error::Result;
use crate::stage::VOCAB_PADDING;
use crate::types::Operands;

/// One product of the step: its name and row-major `(m, n, k)` with A and B transposed or not.
struct Product {
    what: String,
    mnk: (usize, usize, usize),
    ta: bool,
    tb: bool,
    role: Role,
    head: bool,
}

/// Which of a layer's three products a [`Product`] is.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Forward,
    InputGradient,
    WeightGradient,
}

/// A product as the BF16 fast path runs it: `(m, n, k)`, the stored row widths of A and B, and
/// which operand it rounds in the timing (the others are cached copies or rounded for an earlier
/// product of the same layer).
struct Cached {
    mnk: (usize, usize, usize),
    lds: (usize, usize),
    cast_a: bool,
    cast_b: bool,
}

/// `p` on the fast path, the head over `padded` rows of the vocabulary (as `GpuStage` runs it).
fn cached(p: &Product, padded: usize) -> Cached {
    let (m, n, k) = p.mnk;
    match (p.role, p.head) {
        // x rounded (the head's hh once, for its weight gradient too), W its copy.
        (Role::Forward, head) => Cached {
            mnk: if head { (m, padded, k) } else { p.mnk },
            lds: (k, k),
            cast_a: true,
            cast_b: false,
        },
        // dy (the logits' gradient, padded columns zero) rounded, W its copy.
        (Role::InputGradient, head) => {
            let k = if head { padded } else { k };
            Cached {
                mnk: (m, n, k),
                lds: (k, n),
                cast_a: true,
                cast_b: false,
            }
        }
        // dy rounded for the input gradient; x rounded again (the head's hh was kept).
        (Role::WeightGradient, head) => Cached {
            mnk: p.mnk,
            lds: (if head { padded } else { m }, n),
            cast_a: false,
            cast_b: !head,
        },
    }
}

/// A product's time in one way of computing it.
#[derive(Debug, Serialize)]
pub struct GemmTime {
    /// The product (`c_fc forward`, `lm_head weight gradient`, ...).
    pub what: String,
    /// `(m, n, k)`.
    pub mnk: (usize, usize, usize),
    /// How: `fp32`, `tf32`, `bf16 fast (fp32 operands)`, `bf16 operands`, `bf16 operands + casts`,
    /// `bf16 cached weights + casts` (the stage's default: the head's `n` or `k` padded).
    pub how: &'static str,
    /// Median milliseconds per product.
    pub ms: f64,
    /// Tera-FLOP/s (2·m·n·k per product).
    pub tflops: f64,
}

/// Everything `seqpipe gpu gemm` reports.
#[derive(Debug, Serialize)]
pub struct GemmReport {
    /// Every product in every way.
    pub times: Vec<GemmTime>,
    /// Summed milliseconds of all products, per way (one block's products and one head chunk).
    pub totals_ms: Vec<(&'static str, f64)>,
    /// Worst relative L2 difference between the BF16-operand products and the fast-BF16 ones
    /// (both round the operands to BF16: near 0 when cuBLAS rounds them to nearest as
    /// [`Gpu::to_bf16`] does).
    pub bf16_operands_vs_fast_rel_l2: f64,
}

const WAYS: [&str; 6] = [
    "fp32",
    "tf32",
    "bf16 fast (fp32 operands)",
    "bf16 operands",
    "bf16 operands + casts",
    CACHED,
];

/// The BF16 fast path's way.
const CACHED: &str = "bf16 cached weights + casts";

fn products(rows: usize, c: usize, vocab: usize, head_rows: usize) -> Vec<Product> {
    let mut out = Vec::new();
    let linears = [
        ("c_attn", c, 3 * c),
        ("attn.c_proj", c, c),
        ("c_fc", c, 4 * c),
        ("mlp.c_proj", 4 * c, c),
    ];
    // As `Gpu::linear_forward` and `Gpu::linear_backward` call them.
    for (name, d_in, d_out) in linears {
        let p = |what: &str, mnk, ta, tb, role| Product {
            what: format!("{name} {what}"),
            mnk,
            ta,
            tb,
            role,
            head: false,
        };
        out.push(p(
            "forward",
            (rows, d_out, d_in),
            false,
            true,
            Role::Forward,
        ));
        let mnk = (rows, d_in, d_out);
        out.push(p("input gradient", mnk, false, false, Role::InputGradient));
        let mnk = (d_out, d_in, rows);
        out.push(p("weight gradient", mnk, true, false, Role::WeightGradient));
    }
    // As the stage's head runs one chunk of rows.
    let r = head_rows.min(rows);
    let h = |what: &str, mnk, ta, tb, role| Product {
        what: format!("lm_head {what}"),
        mnk,
        ta,
        tb,
        role,
        head: true,
    };
    out.push(h(
        "forward (one chunk)",
        (r, vocab, c),
        false,
        true,
        Role::Forward,
    ));
    let mnk = (r, c, vocab);
    out.push(h(
        "input gradient (one chunk)",
        mnk,
        false,
        false,
        Role::InputGradient,
    ));
    let mnk = (vocab, c, r);
    out.push(h(
        "weight gradient (one chunk)",
        mnk,
        true,
        false,
        Role::WeightGradient,
    ));
    out
}

/// Times every product of a `d_model = c` model at `rows` rows (`vocab` for the head, chunks of
/// `head_rows`) in every way, `reps` times each after one untimed run; returns the report.
pub fn run(
    gpu: &mut Gpu,
    (rows, c, vocab, head_rows): (usize, usize, usize, usize),
    reps: usize,
) -> Result<GemmReport> {
    gpu.bind()?;
    let list = products(rows, c, vocab, head_rows);
    let padded = vocab.div_ceil(VOCAB_PADDING) * VOCAB_PADDING;
    let bufs = Buffers::new(gpu, &list, padded)?;
    let mut times = Vec::new();
    let mut worst: f64 = 0.0;
    let before = gpu.precision();
    for p in &list {
        let path = cached(p, padded);
        for how in WAYS {
            let (m, n, k) = if how == CACHED { path.mnk } else { p.mnk };
            if how == "bf16 operands" || how == CACHED {
                // Operands rounded once, outside the timing (the fast path's weight copies and the
                // operands an earlier product rounded).
                gpu.to_bf16(bufs.a16.ptr(), bufs.a.ptr(), bufs.a_len)?;
                gpu.to_bf16(bufs.b16.ptr(), bufs.b.ptr(), bufs.b_len)?;
            }
            let dst = if how == "bf16 fast (fp32 operands)" {
                bufs.fast.ptr()
            } else {
                bufs.out.ptr()
            };
            let median = median_ms(gpu, reps, |gpu| bufs.product(gpu, p, &path, how, dst))?;
            times.push(GemmTime {
                what: p.what.clone(),
                mnk: (m, n, k),
                how,
                ms: median,
                tflops: 2.0 * (m * n * k) as f64 / (median * 1e-3) / 1e12,
            });
            if how == "bf16 operands" {
                let (x, y) = (
                    gpu.download_prefix(&bufs.out, m * n)?,
                    gpu.download_prefix(&bufs.fast, m * n)?,
                );
                worst = worst.max(rel_l2(&x, &y));
            }
        }
    }
    gpu.set_precision(before);
    // The buffers are freed on return: nothing may still read them.
    gpu.sync()?;
    let totals_ms = WAYS
        .iter()
        .map(|&how| {
            let sum = times.iter().filter(|t| t.how == how).map(|t| t.ms).sum();
            (how, sum)
        })
        .collect();
    Ok(GemmReport {
        times,
        totals_ms,
        bf16_operands_vs_fast_rel_l2: worst,
    })
}

/// The operands every product reads (FP32, with BF16 copies) and the two outputs (the fast
/// BF16 way's apart, to compare with the BF16-operand way's), each as large as the largest
/// product needs in any way.
struct Buffers {
    a: Buf<f32>,
    b: Buf<f32>,
    a16: Buf<u16>,
    b16: Buf<u16>,
    out: Buf<f32>,
    fast: Buf<f32>,
    a_len: usize,
    b_len: usize,
}

impl Buffers {
    /// Room for every way's operands of `list` (the fast path's head reads rows of the `padded`
    /// vocabulary), A and B filled with fixed pseudo-random values.
    fn new(gpu: &Gpu, list: &[Product], padded: usize) -> Result<Self> {
        let biggest = |f: &dyn Fn(&Product, &Cached) -> usize| {
            list.iter()
                .map(|p| f(p, &cached(p, padded)))
                .max()
                .unwrap_or(1)
        };
        let a_len = biggest(&|p, q| {
            let ((m, _, k), lda) = (q.mnk, q.lds.0);
            (p.mnk.0 * p.mnk.2).max(if p.ta { k * lda } else { m * lda })
        });
        let b_len = biggest(&|p, q| {
            let ((_, n, k), ldb) = (q.mnk, q.lds.1);
            (p.mnk.1 * p.mnk.2).max(if p.tb { n * ldb } else { k * ldb })
        });
        let c_len = biggest(&|p, q| (p.mnk.0 * p.mnk.1).max(q.mnk.0 * q.mnk.1));
        let random = |n: usize, salt: u64| -> Vec<f32> {
            (0..n as u64)
                .map(|i| {
                    let x = (i ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                    (x as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
                })
                .collect()
        };
        let a = gpu.upload(&random(a_len, 1))?;
        let b = gpu.upload(&random(b_len, 2))?;
        let out: Buf<f32> = gpu.zeros(c_len)?;
        let fast: Buf<f32> = gpu.zeros(c_len)?;
        let (a16, b16): (Buf<u16>, Buf<u16>) = (gpu.zeros(a_len)?, gpu.zeros(b_len)?);
        Ok(Buffers {
            a,
            b,
            a16,
            b16,
            out,
            fast,
            a_len,
            b_len,
        })
    }

    /// Product `p` once, computed the way `how` (`path`: as the fast path runs it), into `dst`.
    fn product(
        &self,
        gpu: &mut Gpu,
        p: &Product,
        path: &Cached,
        how: &str,
        dst: u64,
    ) -> Result<()> {
        let t = (p.ta, p.tb);
        let (m, n, k) = if how == CACHED { path.mnk } else { p.mnk };
        let (a, b, a16, b16) = (self.a.ptr(), self.b.ptr(), self.a16.ptr(), self.b16.ptr());
        match how {
            "fp32" | "tf32" | "bf16 fast (fp32 operands)" => {
                gpu.set_precision(match how {
                    "fp32" => Precision::Fp32,
                    "tf32" => Precision::Tf32,
                    _ => Precision::Bf16,
                });
                gpu.gemm_of(dst, a, b, p.mnk, t, 0.0, Operands::F32)
            }
            "bf16 operands + casts" => {
                gpu.to_bf16(a16, a, m * k)?;
                gpu.to_bf16(b16, b, n * k)?;
                gpu.gemm_of(dst, a16, b16, p.mnk, t, 0.0, Operands::Bf16)
            }
            CACHED => {
                if path.cast_a {
                    gpu.to_bf16(a16, a, m * k)?;
                }
                if path.cast_b {
                    gpu.to_bf16(b16, b, n * k)?;
                }
                gpu.gemm_bf16(dst, a16, b16, path.mnk, t, path.lds, 0.0)
            }
            _ => gpu.gemm_of(dst, a16, b16, p.mnk, t, 0.0, Operands::Bf16),
        }
    }
}

/// Median milliseconds of `reps` runs of `product` (each waited for), after one untimed run.
fn median_ms(
    gpu: &mut Gpu,
    reps: usize,
    mut product: impl FnMut(&mut Gpu) -> Result<()>,
) -> Result<f64> {
    product(gpu)?;
    gpu.sync()?;
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let started = Instant::now();
        product(gpu)?;
        gpu.sync()?;
        ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn rel_l2(x: &[f32], y: &[f32]) -> f64 {
    let (num, den) = x.iter().zip(y).fold((0.0, 0.0), |(n, d), (&p, &q)| {
        let e = p as f64 - q as f64;
        (n + e * e, d + (q as f64) * (q as f64))
    });
    (num / den.max(1e-30)).sqrt()
}

#[cfg(all(test, feature = "emulate"))]
mod tests {
    use super::*;
    use crate::types::Bf16Path;

    /// Round to nearest even, in Rust: what `to_bf16` must give.
    fn bf16_bits(x: f32) -> u16 {
        let u = x.to_bits();
        if u & 0x7fff_ffff > 0x7f80_0000 {
            return ((u >> 16) | 0x40) as u16;
        }
        ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
    }

    #[test]
    fn to_bf16_rounds_to_nearest_even_and_keeps_nans_and_infinities() {
        let gpu = Gpu::open(0, Precision::Bf16).unwrap();
        // Ties (exactly halfway) round to the even neighbour, both ways; a NaN stays a NaN.
        let x: Vec<f32> = [
            1.0,
            -2.5,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            1e-40,
        ]
        .into_iter()
        .chain((0..1000).map(|i| (i as f32 * 0.7731).sin() * 3.0))
        .collect();
        let buf = gpu.upload(&x).unwrap();
        let out: Buf<u16> = gpu.zeros(x.len()).unwrap();
        gpu.to_bf16(out.ptr(), buf.ptr(), x.len()).unwrap();
        let got = gpu.download(&out).unwrap();
        let want: Vec<u16> = x.iter().map(|&v| bf16_bits(v)).collect();
        assert_eq!(got, want);
        assert_eq!(&got[2..4], &[0x3f80, 0x3f82]);
        assert_eq!(got[4], 0x3f81);
        assert_eq!(got[7] & 0x7f80, 0x7f80);
        assert_ne!(got[7] & 0x7f, 0);
    }

    /// The bench runs every product in every way on a tiny model (the head over a vocabulary
    /// that needs padding), and the BF16-operand products match the fast BF16 ones closely.
    #[test]
    fn every_product_is_timed_in_every_way() {
        let mut gpu = Gpu::open(0, Precision::Fp32).unwrap();
        let report = run(&mut gpu, (8, 16, 40, 8), 1).unwrap();
        let list = products(8, 16, 40, 8);
        assert_eq!(
            list.len(),
            15,
            "4 linear layers x 3 products, and the head's 3"
        );
        assert_eq!(report.times.len(), list.len() * WAYS.len());
        let expected = list
            .iter()
            .flat_map(|p| WAYS.iter().map(move |&how| (p, how)));
        for (time, (p, how)) in report.times.iter().zip(expected) {
            assert_eq!((time.what.as_str(), time.how), (p.what.as_str(), how));
            assert!(time.ms > 0.0 && time.tflops > 0.0, "{time:?}");
        }
        let padded = 40usize.div_ceil(VOCAB_PADDING) * VOCAB_PADDING;
        let head = report
            .times
            .iter()
            .find(|t| t.how == CACHED && t.what == "lm_head forward (one chunk)");
        assert_eq!(head.unwrap().mnk, (8, padded, 16));
        assert_eq!(report.totals_ms.len(), WAYS.len());
        let rel = report.bf16_operands_vs_fast_rel_l2;
        assert!(rel.is_finite() && rel < 1e-2, "{rel}");
        assert_eq!(
            gpu.precision(),
            Precision::Fp32,
            "the precision is restored"
        );
    }

    /// With BF16 operands on, every product of BF16 mode is the BF16 product of rounded copies
    /// (bit for bit), the copies grow with the products, and FP32 mode ignores the switch.
    #[test]
    fn bf16_operand_mode_rounds_both_operands_of_every_product() {
        let mut gpu = Gpu::open(0, Precision::Bf16).unwrap();
        let values = |n: usize, s: f32| -> Vec<f32> {
            (0..n).map(|i| ((i as f32 + s) * 0.377).sin()).collect()
        };
        for (m, n, k, ta, tb) in [(3, 5, 7, false, true), (9, 4, 33, true, false)] {
            let (a, b) = (values(m * k, 0.5), values(k * n, 1.5));
            let (da, db) = (gpu.upload(&a).unwrap(), gpu.upload(&b).unwrap());
            let c: Buf<f32> = gpu.zeros(m * n).unwrap();
            let run = |gpu: &mut Gpu, on: bool, precision| {
                gpu.set_bf16_path(if on {
                    Bf16Path::Operands
                } else {
                    Bf16Path::Fp32Operands
                });
                gpu.set_precision(precision);
                gpu.gemm(c.ptr(), da.ptr(), db.ptr(), (m, n, k), ta, tb, 0.0)
                    .unwrap();
                gpu.download(&c).unwrap()
            };
            let plain = run(&mut gpu, false, Precision::Bf16);
            let rounded = run(&mut gpu, true, Precision::Bf16);
            assert!(gpu.bf16_operands());
            let (a16, b16): (Buf<u16>, Buf<u16>) =
                (gpu.zeros(m * k).unwrap(), gpu.zeros(k * n).unwrap());
            gpu.to_bf16(a16.ptr(), da.ptr(), m * k).unwrap();
            gpu.to_bf16(b16.ptr(), db.ptr(), k * n).unwrap();
            let (a16, b16) = (a16.ptr(), b16.ptr());
            gpu.gemm_of(c.ptr(), a16, b16, (m, n, k), (ta, tb), 0.0, Operands::Bf16)
                .unwrap();
            assert_eq!(rounded, gpu.download(&c).unwrap());
            assert_ne!(rounded, plain);
            assert!(rel_l2(&rounded, &plain) < 1e-2);
            assert_eq!(run(&mut gpu, true, Precision::Fp32), plain);
            assert!(!gpu.bf16_operands());
        }
    }
}
