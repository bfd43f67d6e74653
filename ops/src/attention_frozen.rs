//! The unmasked attention kernels as they were before document masks (commit ad77375), frozen
//! for one test: the kernels with a one-document mask must reproduce them bit for bit.

use candle_core::Tensor;
use rayon::prelude::*;

use crate::cpu::{Float, Mat, Threads, View, lane_max, lane_sum, matmul, tensor};
use crate::error::Result;

/// Queries per block.
const Q_BLOCK: usize = 64;

#[derive(Clone, Copy)]
pub(crate) struct Shape {
    b: usize,
    h: usize,
    s: usize,
    p: usize,
    d: usize,
}

impl Shape {
    /// Keys per (batch, head): `P + s`.
    fn l(&self) -> usize {
        self.p + self.s
    }
}

/// Query block `t0..t1` of a segment with prefix `p`: keys `0..p + t1` are visible to some query.
fn block(t0: usize, s: usize, p: usize) -> (usize, usize, usize) {
    let t1 = (t0 + Q_BLOCK).min(s);
    (t0, t1, p + t1)
}

/// The first `len` elements of `scratch`, grown (with zeros) when it is shorter; old contents stay.
fn reuse<T: Float>(scratch: &mut Vec<T>, len: usize) -> &mut [T] {
    if scratch.len() < len {
        scratch.resize(len, T::zero());
    }
    &mut scratch[..len]
}

/// Scores of queries `q_blk` `(nb, D)` against keys `k` `(lk, D)` into `scores` `(nb, lk)`.
fn block_scores<T: Float>(scores: &mut [T], q_blk: &[T], k: &[T], nb: usize, lk: usize, d: usize) {
    matmul(
        scores,
        lk,
        false,
        Mat::rows(q_blk, nb, d, d),
        Mat::transposed(k, d, lk, d),
        Threads::One,
    );
}

pub(crate) fn forward<T: Float>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    sh: Shape,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "causal_prefix_attention_forward";
    let Shape { b, h, s, p, d } = sh;
    let l = sh.l();
    let (qv, kv, vv) = (View::new(q, OP)?, View::new(k, OP)?, View::new(v, OP)?);
    let (qs, ks, vs) = (qv.slice::<T>()?, kv.slice::<T>()?, vv.slice::<T>()?);
    let scale = T::from_f64(scale);
    let mut out = vec![T::zero(); b * h * s * d]; // (B, H, s, D)
    let mut lse = vec![T::zero(); b * h * s]; // (B, H, s)
    if s > 0 {
        out.par_chunks_mut(s * d)
            .zip(lse.par_chunks_mut(s))
            .enumerate()
            .for_each(|(bh, (out, lse))| {
                let (q, k, v) = (
                    &qs[bh * s * d..(bh + 1) * s * d],
                    &ks[bh * l * d..(bh + 1) * l * d],
                    &vs[bh * l * d..(bh + 1) * l * d],
                );
                out.par_chunks_mut(Q_BLOCK * d)
                    .zip(lse.par_chunks_mut(Q_BLOCK))
                    .enumerate()
                    // One score buffer per task, reused by its blocks: the gemm overwrites
                    // every entry it is given, so it is never cleared.
                    .for_each_init(Vec::new, |scratch, (blk, (out, lse))| {
                        let (t0, t1, lk) = block(blk * Q_BLOCK, s, p);
                        let nb = t1 - t0;
                        let probs = reuse(scratch, nb * lk); // (nb, lk)
                        block_scores(probs, &q[t0 * d..t1 * d], k, nb, lk, d);
                        for (i, row) in probs.chunks_mut(lk).enumerate() {
                            let visible = p + t0 + i + 1;
                            let (seen, masked) = row.split_at_mut(visible);
                            let max = lane_max(seen) * scale;
                            // The exponentials first, then their sum in lanes: both loops
                            // vectorize (a running sum would serialize the exponentials).
                            seen.iter_mut()
                                .for_each(|x| *x = (*x * scale - max).exp_fast());
                            let sum = lane_sum(seen);
                            let inv = T::one() / sum;
                            seen.iter_mut().for_each(|x| *x *= inv);
                            masked.fill(T::zero());
                            lse[i] = max + sum.ln();
                        }
                        matmul(
                            out,
                            d,
                            false,
                            Mat::rows(probs, nb, lk, lk),
                            Mat::rows(v, lk, d, d),
                            Threads::One,
                        );
                    });
            });
    }
    Ok((tensor(out, &[b, h, s, d])?, tensor(lse, &[b, h, s, 1])?))
}

/// Tensors the backward reads, as slices of one (batch, head).
struct HeadInputs<'a, T> {
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
    out: &'a [T],
    lse: &'a [T],
    d_out: &'a [T],
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<T: Float>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    d_out: &Tensor,
    scale: f64,
    sh: Shape,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "causal_prefix_attention_backward";
    let Shape { b, h, s, d, .. } = sh;
    let l = sh.l();
    let views = [q, k, v, out, lse, d_out]
        .into_iter()
        .map(|t| View::new(t, OP))
        .collect::<Result<Vec<_>>>()?;
    let [qs, ks, vs, outs, lses, d_outs] = [0, 1, 2, 3, 4, 5].map(|i| views[i].slice::<T>());
    let (qs, ks, vs, outs, lses, d_outs) = (qs?, ks?, vs?, outs?, lses?, d_outs?);
    let mut dq = vec![T::zero(); b * h * s * d]; // (B, H, s, D)
    let mut dk = vec![T::zero(); b * h * l * d]; // (B, H, L, D)
    let mut dv = vec![T::zero(); b * h * l * d]; // (B, H, L, D)
    if s > 0 {
        dq.par_chunks_mut(s * d)
            .zip(dk.par_chunks_mut(l * d))
            .zip(dv.par_chunks_mut(l * d))
            .enumerate()
            .for_each(|(bh, ((dq, dk), dv))| {
                let (sd, ld) = (bh * s * d..(bh + 1) * s * d, bh * l * d..(bh + 1) * l * d);
                let inputs = HeadInputs {
                    q: &qs[sd.clone()],
                    k: &ks[ld.clone()],
                    v: &vs[ld],
                    out: &outs[sd.clone()],
                    lse: &lses[bh * s..(bh + 1) * s],
                    d_out: &d_outs[sd],
                };
                head_backward(&inputs, dq, dk, dv, T::from_f64(scale), sh);
            });
    }
    Ok((
        tensor(dq, &[b, h, s, d])?,
        tensor(dk, &[b, h, l, d])?,
        tensor(dv, &[b, h, l, d])?,
    ))
}

/// Backward of one (batch, head), query blocks in order, accumulating `dk` and `dv`.
fn head_backward<T: Float>(
    x: &HeadInputs<'_, T>,
    dq: &mut [T],
    dk: &mut [T],
    dv: &mut [T],
    scale: T,
    sh: Shape,
) {
    let Shape { s, p, d, .. } = sh;
    // Score buffers for the largest block, reused by every block: the gemms overwrite every entry
    // they are given, so they are never cleared.
    let most = Q_BLOCK.min(s) * sh.l();
    let (mut probs_buf, mut ds_buf) = (vec![T::zero(); most], vec![T::zero(); most]);
    for t0 in (0..s).step_by(Q_BLOCK) {
        let (t0, t1, lk) = block(t0, s, p);
        let nb = t1 - t0;
        let (q_blk, d_out_blk) = (&x.q[t0 * d..t1 * d], &x.d_out[t0 * d..t1 * d]);
        // probs = exp(scale * q k^T - lse) on the visible keys, 0 elsewhere. // (nb, lk)
        let probs = &mut probs_buf[..nb * lk];
        block_scores(probs, q_blk, x.k, nb, lk, d);
        for (i, row) in probs.chunks_mut(lk).enumerate() {
            let (seen, masked) = row.split_at_mut(p + t0 + i + 1);
            let lse = x.lse[t0 + i];
            seen.iter_mut()
                .for_each(|z| *z = (*z * scale - lse).exp_fast());
            masked.fill(T::zero());
        }
        // dv += probs^T d_out
        matmul(
            &mut dv[..lk * d],
            d,
            true,
            Mat::transposed(probs, lk, nb, lk),
            Mat::rows(d_out_blk, nb, d, d),
            Threads::One,
        );
        // dprobs = d_out v^T, then ds = scale * probs * (dprobs - sum(d_out * out)). // (nb, lk)
        let ds = &mut ds_buf[..nb * lk];
        block_scores(ds, d_out_blk, x.v, nb, lk, d);
        for (i, (ds, probs)) in ds.chunks_mut(lk).zip(probs.chunks(lk)).enumerate() {
            let t = t0 + i;
            let delta: T = d_out_blk[i * d..(i + 1) * d]
                .iter()
                .zip(&x.out[t * d..(t + 1) * d])
                .map(|(&a, &b)| a * b)
                .sum();
            ds.iter_mut()
                .zip(probs)
                .for_each(|(g, &pr)| *g = scale * pr * (*g - delta));
        }
        // dq = ds k, dk += ds^T q
        matmul(
            &mut dq[t0 * d..t1 * d],
            d,
            false,
            Mat::rows(ds, nb, lk, lk),
            Mat::rows(x.k, lk, d, d),
            Threads::One,
        );
        matmul(
            &mut dk[..lk * d],
            d,
            true,
            Mat::transposed(ds, lk, nb, lk),
            Mat::rows(q_blk, nb, d, d),
            Threads::One,
        );
    }
}

/// The new kernels with one document per sequence (the unmasked entry points, and the masked ones
/// given [`DocumentMask::single`]) against the frozen kernels: bit-identical outputs and gradients,
/// f32 and f64, with and without a prefix, over one and several query blocks.
#[test]
fn one_document_is_bit_identical_to_the_frozen_unmasked_kernel() {
    use crate::documents::DocumentMask;
    use crate::{
        causal_prefix_attention_backward, causal_prefix_attention_forward,
        document_prefix_attention_backward, document_prefix_attention_forward,
    };
    use candle_core::{DType, Device};

    let mut seed = 0x5eed_u64;
    let mut rand = |shape: &[usize], dtype: DType| {
        let n: usize = shape.iter().product();
        let data: Vec<f64> = (0..n)
            .map(|_| {
                // xorshift64*: a fixed, dependency-free stream in [-1, 1).
                seed ^= seed >> 12;
                seed ^= seed << 25;
                seed ^= seed >> 27;
                let x = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
                (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            })
            .collect();
        Tensor::from_vec(data, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    let bits = |t: &Tensor| -> Vec<u64> {
        let t = t.flatten_all().unwrap();
        match t.dtype() {
            DType::F32 => t
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            _ => t
                .to_vec1::<f64>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        }
    };
    for dtype in [DType::F32, DType::F64] {
        for (b, h, s, p, d) in [
            (2, 2, 5, 0, 4),
            (1, 3, 7, 9, 8),
            (2, 1, 130, 0, 16),
            (1, 2, 70, 100, 8),
        ] {
            let what = format!("{dtype:?} b={b} h={h} s={s} P={p} d={d}");
            let (q, k, v, g) = (
                rand(&[b, h, s, d], dtype),
                rand(&[b, h, p + s, d], dtype),
                rand(&[b, h, p + s, d], dtype),
                rand(&[b, h, s, d], dtype),
            );
            let sh = Shape { b, h, s, p, d };
            let scale = 0.37;
            let (old_out, old_lse, old_grads) = match dtype {
                DType::F32 => {
                    let (o, l) = forward::<f32>(&q, &k, &v, scale, sh).unwrap();
                    let gr = backward::<f32>(&q, &k, &v, &o, &l, &g, scale, sh).unwrap();
                    (o, l, gr)
                }
                _ => {
                    let (o, l) = forward::<f64>(&q, &k, &v, scale, sh).unwrap();
                    let gr = backward::<f64>(&q, &k, &v, &o, &l, &g, scale, sh).unwrap();
                    (o, l, gr)
                }
            };
            let mask = DocumentMask::single(b);
            let runs = [
                {
                    let (o, c) = causal_prefix_attention_forward(&q, &k, &v, scale).unwrap();
                    let gr = causal_prefix_attention_backward(&c, &k, &v, &g, scale).unwrap();
                    (o, c.lse, gr)
                },
                {
                    let (o, c) =
                        document_prefix_attention_forward(&q, &k, &v, scale, &mask, 0).unwrap();
                    let gr = document_prefix_attention_backward(&c, &k, &v, &g, scale, &mask, 0)
                        .unwrap();
                    (o, c.lse, gr)
                },
            ];
            for (o, l, (dq, dk, dv)) in runs {
                assert_eq!(bits(&o), bits(&old_out), "out {what}");
                assert_eq!(bits(&l), bits(&old_lse), "lse {what}");
                assert_eq!(bits(&dq), bits(&old_grads.0), "dq {what}");
                assert_eq!(bits(&dk), bits(&old_grads.1), "dk {what}");
                assert_eq!(bits(&dv), bits(&old_grads.2), "dv {what}");
            }
        }
    }
}
