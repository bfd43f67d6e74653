//! Document-masked prefix attention against a dense masked reference (naive softmax with a -inf
//! mask, f64), finite differences, and the segmented computation (Seq1F1B: K/V prefix, dK/dV
//! summed back) against the unsegmented one, on random document layouts and the edge cases.

use candle_core::{DType, Tensor};
use ops::{DocumentMask, document_prefix_attention_backward, document_prefix_attention_forward};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::common::*;

/// Dense masked attention of queries at absolute positions `key_start + P ..` over keys at
/// `key_start ..`, in plain loops: masked scores are -inf, softmax over the whole key row.
/// Returns `(out, lse, dq, dk, dv)` for the output gradient `g`.
fn dense_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    scale: f64,
    mask: &DocumentMask,
    key_start: usize,
) -> [Vec<f64>; 5] {
    let (b, h, s, d) = q.dims4().unwrap();
    let l = k.dims()[2];
    let p = l - s;
    let (qv, kv, vv, gv) = (vals(q), vals(k), vals(v), vals(g));
    let mut out = vec![0.0; b * h * s * d];
    let mut lse = vec![0.0; b * h * s];
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; b * h * s * d],
        vec![0.0; b * h * l * d],
        vec![0.0; b * h * l * d],
    );
    let row = |x: &[f64], i: usize| x[i * d..(i + 1) * d].to_vec();
    let dotv = |a: &[f64], c: &[f64]| a.iter().zip(c).map(|(x, y)| x * y).sum::<f64>();
    for bi in 0..b {
        for hi in 0..h {
            let bh = bi * h + hi;
            for t in 0..s {
                let pos = key_start + p + t;
                let own = mask.doc_start(bi, pos);
                let qr = row(&qv, bh * s + t);
                let scores: Vec<f64> = (0..l)
                    .map(|j| {
                        let kpos = key_start + j;
                        if kpos >= own && kpos <= pos {
                            scale * dotv(&qr, &row(&kv, bh * l + j))
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                lse[bh * s + t] = m + z.ln();
                let probs: Vec<f64> = scores.iter().map(|x| (x - m).exp() / z).collect();
                let gr = row(&gv, bh * s + t);
                for (j, &w) in probs.iter().enumerate() {
                    for c in 0..d {
                        out[(bh * s + t) * d + c] += w * vv[(bh * l + j) * d + c];
                        dv[(bh * l + j) * d + c] += w * gr[c];
                    }
                }
                // dS = P * (dP - sum(P * dP)), dP_j = g . v_j
                let dp: Vec<f64> = (0..l).map(|j| dotv(&gr, &row(&vv, bh * l + j))).collect();
                let delta: f64 = probs.iter().zip(&dp).map(|(a, c)| a * c).sum();
                for j in 0..l {
                    let ds = probs[j] * (dp[j] - delta) * scale;
                    for c in 0..d {
                        dq[(bh * s + t) * d + c] += ds * kv[(bh * l + j) * d + c];
                        dk[(bh * l + j) * d + c] += ds * qr[c];
                    }
                }
            }
        }
    }
    [out, lse, dq, dk, dv]
}

/// Random document starts for a sequence of `len` tokens: each start is drawn from a mix of
/// one-token documents, short ones and long ones.
fn random_layout(r: &mut ChaCha8Rng, len: usize) -> Vec<usize> {
    let mut starts = vec![0];
    let mut at = 0;
    loop {
        let doc = match r.random_range(0..4) {
            0 => 1,
            1 => r.random_range(1..8),
            2 => r.random_range(8..40),
            _ => r.random_range(40..200),
        };
        at += doc;
        if at >= len {
            return starts;
        }
        starts.push(at);
    }
}

fn kernel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    scale: f64,
    mask: &DocumentMask,
    key_start: usize,
) -> [Tensor; 5] {
    let (out, ctx) = document_prefix_attention_forward(q, k, v, scale, mask, key_start).unwrap();
    let (dq, dk, dv) =
        document_prefix_attention_backward(&ctx, k, v, g, scale, mask, key_start).unwrap();
    [out, ctx.lse, dq, dk, dv]
}

const NAMES: [&str; 5] = ["out", "lse", "dq", "dk", "dv"];

/// Property: on random layouts, prefixes and segment sizes (one and several query blocks), the
/// kernels equal the dense masked reference.
#[test]
fn matches_dense_masked_reference_on_random_layouts() {
    let mut r = rng(3201);
    for case in 0..24 {
        let b = r.random_range(1..3);
        let h = r.random_range(1..3);
        let d = r.random_range(2..6);
        let s = [1, 5, 17, 64, 65, 150][case % 6];
        let p = [0, 1, 30, 97][r.random_range(0..4)];
        let rows: Vec<Vec<usize>> = (0..b).map(|_| random_layout(&mut r, p + s)).collect();
        let mask = DocumentMask::new(rows.clone()).unwrap();
        let q = rand_scaled(&mut r, &[b, h, s, d], 1.5);
        let k = rand_scaled(&mut r, &[b, h, p + s, d], 1.5);
        let v = rand_t(&mut r, &[b, h, p + s, d]);
        let g = rand_t(&mut r, &[b, h, s, d]);
        let got = kernel(&q, &k, &v, &g, 0.6, &mask, 0);
        let want = dense_reference(&q, &k, &v, &g, 0.6, &mask, 0);
        for i in 0..5 {
            assert_close_vec(
                &vals(&got[i]),
                &want[i],
                1e-11,
                1e-13,
                &format!("{} case {case} s={s} P={p} layout {rows:?}", NAMES[i]),
            );
        }
    }
}

#[test]
fn backward_matches_finite_differences() {
    let mut r = rng(3202);
    // Documents [0, 2), [2, 3) (one token), [3, 7) spanning the prefix/segment boundary at 5,
    // [7, 9); a second row with a document starting exactly at the segment (position 5).
    let mask = DocumentMask::new(vec![vec![0, 2, 3, 7], vec![0, 5]]).unwrap();
    let (b, h, s, p, d) = (2, 2, 4, 5, 3);
    let inputs = [
        rand_scaled(&mut r, &[b, h, s, d], 1.5),
        rand_scaled(&mut r, &[b, h, p + s, d], 1.5),
        rand_t(&mut r, &[b, h, p + s, d]),
    ];
    let g = rand_t(&mut r, &[b, h, s, d]);
    let f = |a: &[Tensor]| {
        dot(
            &g,
            &document_prefix_attention_forward(&a[0], &a[1], &a[2], 0.7, &mask, 0)
                .unwrap()
                .0,
        )
    };
    let got = kernel(&inputs[0], &inputs[1], &inputs[2], &g, 0.7, &mask, 0);
    check_grad(&f, &inputs, 0, &got[2], "dq");
    check_grad(&f, &inputs, 1, &got[3], "dk");
    check_grad(&f, &inputs, 2, &got[4], "dv");
}

/// Runs the sequence as Seq1F1B segments `cuts` (each with the K/V prefix of the earlier ones),
/// sums each segment's dK/dV into the whole sequence's, and compares with the unsegmented masked
/// attention. `trim` starts each segment's K/V prefix at the mask's `prefix_start` instead of 0.
fn check_segmented(
    rows: Vec<Vec<usize>>,
    cuts: &[usize],
    d: usize,
    dtype: DType,
    trim: bool,
    seed: u64,
) {
    let mut r = rng(seed);
    let (b, h, t) = (rows.len(), 2, cuts.iter().sum::<usize>());
    let mask = DocumentMask::new(rows.clone()).unwrap();
    let conv = |x: Tensor| x.to_dtype(dtype).unwrap();
    let q = conv(rand_scaled(&mut r, &[b, h, t, d], 1.5));
    let k = conv(rand_scaled(&mut r, &[b, h, t, d], 1.5));
    let v = conv(rand_t(&mut r, &[b, h, t, d]));
    let g = conv(rand_t(&mut r, &[b, h, t, d]));
    let full = kernel(&q, &k, &v, &g, 0.5, &mask, 0);
    let (mut outs, mut dqs) = (Vec::new(), Vec::new());
    let mut dk_sum = vec![0.0; b * h * t * d];
    let mut dv_sum = vec![0.0; b * h * t * d];
    let mut start = 0;
    for &len in cuts {
        let key_start = if trim { mask.prefix_start(start) } else { 0 };
        let keys = start + len - key_start;
        let seg = |x: &Tensor, from, n| x.narrow(2, from, n).unwrap();
        let [out, _, dq, dk, dv] = kernel(
            &seg(&q, start, len),
            &seg(&k, key_start, keys),
            &seg(&v, key_start, keys),
            &seg(&g, start, len),
            0.5,
            &mask,
            key_start,
        );
        let (dkv, dvv) = (vals(&dk), vals(&dv));
        for bh in 0..b * h {
            for j in 0..keys {
                for c in 0..d {
                    dk_sum[(bh * t + key_start + j) * d + c] += dkv[(bh * keys + j) * d + c];
                    dv_sum[(bh * t + key_start + j) * d + c] += dvv[(bh * keys + j) * d + c];
                }
            }
        }
        outs.push(out);
        dqs.push(dq);
        start += len;
    }
    let what = format!("{dtype:?} cuts {cuts:?} trim {trim} layout {rows:?}");
    let pairs = [
        (vals(&Tensor::cat(&outs, 2).unwrap()), vals(&full[0])),
        (vals(&Tensor::cat(&dqs, 2).unwrap()), vals(&full[2])),
        (dk_sum, vals(&full[3])),
        (dv_sum, vals(&full[4])),
    ];
    for ((got, want), name) in pairs.iter().zip(["out", "dq", "dk", "dv"]) {
        if dtype == DType::F64 {
            assert_close_vec(got, want, 1e-12, 1e-13, &format!("{name} {what}"));
        } else {
            // f32: the segmented run sums in another order; relative error of the whole tensor.
            let err: f64 = got.iter().zip(want).map(|(a, e)| (a - e).powi(2)).sum();
            let norm: f64 = want.iter().map(|e| e * e).sum();
            let rel = (err / norm).sqrt();
            assert!(rel <= 1e-5, "{name} {what}: relative error {rel:e}");
        }
    }
}

/// Property: concatenating the segments equals the unsegmented masked attention, on random
/// layouts and random cuts, with the full K/V prefix and with the prefix trimmed to the earliest
/// document start the segment's queries need.
#[test]
fn segments_reproduce_unsegmented_masked_attention_on_random_layouts() {
    let mut r = rng(3203);
    for case in 0..16u64 {
        let k = r.random_range(1..6);
        let cuts: Vec<usize> = (0..k).map(|_| r.random_range(1..90)).collect();
        let t: usize = cuts.iter().sum();
        let rows = (0..2).map(|_| random_layout(&mut r, t)).collect();
        let dtype = if case % 4 == 3 {
            DType::F32
        } else {
            DType::F64
        };
        check_segmented(rows, &cuts, 4, dtype, case % 2 == 1, 4000 + case);
    }
}

/// The edge cases by construction: a document spanning several segments, documents shorter than
/// a segment, a document starting exactly at a segment boundary, one-token documents (also at
/// both ends of a segment), one document for the whole sequence.
#[test]
fn segments_reproduce_unsegmented_masked_attention_edge_cases() {
    let cuts = [10, 10, 10, 10];
    let layouts = [
        // [0, 3) short, [3, 35) spans segments 0..=3, [35, 40).
        vec![0, 3, 35],
        // Documents starting exactly at every segment boundary.
        vec![0, 10, 20, 30],
        // One-token documents everywhere.
        (0..40).collect(),
        // One-token documents at a segment's first and last positions.
        vec![0, 9, 10, 11, 19, 20, 21],
        // One document.
        vec![0],
        // A last document of one token.
        vec![0, 39],
    ];
    for (i, rows) in layouts.iter().enumerate() {
        for trim in [false, true] {
            let two = vec![rows.clone(), vec![0, 17]];
            check_segmented(two, &cuts, 3, DType::F64, trim, 5000 + i as u64);
        }
    }
    // Several query blocks (64) per segment, documents crossing blocks and segments.
    check_segmented(
        vec![vec![0, 63, 64, 65, 200, 333], vec![0, 128]],
        &[150, 130, 70],
        4,
        DType::F64,
        true,
        5100,
    );
}

/// Keys of other documents get exactly zero dK/dV: what is carried back to earlier segments
/// follows the mask, and keys before the queries' earliest document start are never touched.
#[test]
fn carried_dk_dv_follow_the_mask() {
    let mut r = rng(3204);
    let (h, s, p, d) = (2, 6, 10, 3);
    // Row 0: the segment's queries (positions 10..16) belong to documents starting at 7 and 13.
    // Row 1: one document from 0.
    let mask = DocumentMask::new(vec![vec![0, 4, 7, 13], vec![0]]).unwrap();
    let q = rand_t(&mut r, &[2, h, s, d]);
    let k = rand_t(&mut r, &[2, h, p + s, d]);
    let v = rand_t(&mut r, &[2, h, p + s, d]);
    let g = rand_t(&mut r, &[2, h, s, d]);
    let [_, _, _, dk, dv] = kernel(&q, &k, &v, &g, 0.5, &mask, 0);
    let (dkv, dvv) = (vals(&dk), vals(&dv));
    for hi in 0..h {
        for j in 0..p + s {
            let nonzero = |x: &[f64], b: usize| {
                x[((b * h + hi) * (p + s) + j) * d..][..d]
                    .iter()
                    .any(|&e| e != 0.0)
            };
            // Row 0: keys 0..7 belong to no query's document.
            assert_eq!(nonzero(&dkv, 0), j >= 7, "dk row 0 key {j}");
            assert_eq!(nonzero(&dvv, 0), j >= 7, "dv row 0 key {j}");
            assert!(nonzero(&dkv, 1) && nonzero(&dvv, 1), "row 1 key {j}");
        }
    }
    assert_eq!(mask.prefix_start(10), 0, "row 1 needs the whole prefix");
    let one = DocumentMask::new(vec![vec![0, 4, 7, 13]]).unwrap();
    assert_eq!(one.prefix_start(10), 7);
    assert_eq!(one.prefix_start(13), 13);
}

#[test]
fn rejects_bad_masks() {
    for (rows, needle) in [
        (vec![vec![1, 5]], "position 0"),
        (vec![vec![]], "position 0"),
        (vec![vec![0, 5, 5]], "strictly increasing"),
        (vec![vec![0, 7, 3]], "strictly increasing"),
    ] {
        let e = DocumentMask::new(rows).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
    let mut r = rng(3205);
    let q = rand_t(&mut r, &[2, 1, 4, 3]);
    let kv = rand_t(&mut r, &[2, 1, 8, 3]);
    let e = document_prefix_attention_forward(&q, &kv, &kv, 1.0, &DocumentMask::single(1), 0)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 rows") && e.contains("2 sequences"), "{e}");
    // Queries at 6..10 of row 1 belong to the document starting at 3: a K/V prefix from 5 is cut
    // too short.
    let mask = DocumentMask::new(vec![vec![0, 6], vec![0, 3]]).unwrap();
    let q = rand_t(&mut r, &[2, 1, 4, 3]);
    let kv = rand_t(&mut r, &[2, 1, 5, 3]);
    let e = document_prefix_attention_forward(&q, &kv, &kv, 1.0, &mask, 5)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sequence 1") && e.contains("starting at 3") && e.contains("(3)"),
        "{e}"
    );
}
