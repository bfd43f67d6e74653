use candle_core::Tensor;
use ops::{causal_prefix_attention_backward, causal_prefix_attention_forward};

use crate::common::*;

/// Plain-loop reference: returns (out, lse) for queries at positions P..P+s.
fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> (Tensor, Tensor) {
    let (b, h, s, d) = q.dims4().unwrap();
    let l = k.dims()[2];
    let p = l - s;
    let (qv, kv, vv) = (vals(q), vals(k), vals(v));
    let mut out = vec![0.0; b * h * s * d];
    let mut lse = vec![0.0; b * h * s];
    for bh in 0..b * h {
        for t in 0..s {
            let qrow = &qv[(bh * s + t) * d..(bh * s + t + 1) * d];
            let scores: Vec<f64> = (0..=p + t)
                .map(|j| {
                    let krow = &kv[(bh * l + j) * d..(bh * l + j + 1) * d];
                    scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>()
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
            lse[bh * s + t] = m + z.ln();
            for (j, sc) in scores.iter().enumerate() {
                let w = (sc - m).exp() / z;
                for c in 0..d {
                    out[(bh * s + t) * d + c] += w * vv[(bh * l + j) * d + c];
                }
            }
        }
    }
    (
        Tensor::from_vec(out, (b, h, s, d), q.device()).unwrap(),
        Tensor::from_vec(lse, (b, h, s, 1), q.device()).unwrap(),
    )
}

#[test]
fn forward_matches_naive() {
    let mut r = rng(90);
    for p in [0, 3] {
        let (s, d) = (4, 5);
        let q = rand_t(&mut r, &[2, 3, s, d]);
        let k = rand_t(&mut r, &[2, 3, p + s, d]);
        let v = rand_t(&mut r, &[2, 3, p + s, d]);
        let scale = 1.0 / (d as f64).sqrt();
        let (out, ctx) = causal_prefix_attention_forward(&q, &k, &v, scale).unwrap();
        let (out_ref, lse_ref) = naive_attention(&q, &k, &v, scale);
        assert_close(&out, &out_ref, 1e-13, 1e-14, &format!("out P={p}"));
        assert_close(&ctx.lse, &lse_ref, 1e-13, 1e-14, &format!("lse P={p}"));
        assert_bit_identical(&ctx.out, &out, "ctx.out");
    }
}

fn grad_check(b: usize, h: usize, s: usize, p: usize, seed: u64) {
    let mut r = rng(seed);
    let d = 4;
    let inputs = [
        rand_scaled(&mut r, &[b, h, s, d], 1.5),
        rand_scaled(&mut r, &[b, h, p + s, d], 1.5),
        rand_t(&mut r, &[b, h, p + s, d]),
    ];
    let g = rand_t(&mut r, &[b, h, s, d]);
    let scale = 0.7;
    let f = |a: &[Tensor]| {
        dot(
            &g,
            &causal_prefix_attention_forward(&a[0], &a[1], &a[2], scale)
                .unwrap()
                .0,
        )
    };
    let (_, ctx) =
        causal_prefix_attention_forward(&inputs[0], &inputs[1], &inputs[2], scale).unwrap();
    let (dq, dk, dv) =
        causal_prefix_attention_backward(&ctx, &inputs[1], &inputs[2], &g, scale).unwrap();
    check_grad(&f, &inputs, 0, &dq, &format!("dq P={p}"));
    check_grad(&f, &inputs, 1, &dk, &format!("dk P={p}"));
    check_grad(&f, &inputs, 2, &dv, &format!("dv P={p}"));
}

#[test]
fn backward_matches_finite_differences_without_prefix() {
    grad_check(2, 2, 3, 0, 91);
}

#[test]
fn backward_matches_finite_differences_with_prefix() {
    grad_check(2, 2, 3, 2, 92);
}

/// More queries than one block of the blocked kernel (64), with and without a prefix: the
/// causal skipping of keys per block and the dK/dV accumulation over blocks.
#[test]
fn backward_matches_finite_differences_over_several_query_blocks() {
    grad_check(1, 1, 70, 0, 94);
    grad_check(1, 1, 66, 5, 95);
}

#[test]
fn forward_matches_naive_over_several_query_blocks() {
    let mut r = rng(96);
    for (s, p) in [(130, 0), (64, 1), (65, 70)] {
        let d = 3;
        let q = rand_t(&mut r, &[1, 2, s, d]);
        let k = rand_t(&mut r, &[1, 2, p + s, d]);
        let v = rand_t(&mut r, &[1, 2, p + s, d]);
        let (out, ctx) = causal_prefix_attention_forward(&q, &k, &v, 0.6).unwrap();
        let (out_ref, lse_ref) = naive_attention(&q, &k, &v, 0.6);
        assert_close(&out, &out_ref, 1e-12, 1e-14, &format!("out s={s} P={p}"));
        assert_close(
            &ctx.lse,
            &lse_ref,
            1e-12,
            1e-14,
            &format!("lse s={s} P={p}"),
        );
    }
}

#[test]
fn segments_reproduce_full_causal_attention() {
    let mut r = rng(93);
    let (b, h, t, d) = (2, 2, 7, 4);
    let scale = 0.5;
    let q = rand_t(&mut r, &[b, h, t, d]);
    let k = rand_t(&mut r, &[b, h, t, d]);
    let v = rand_t(&mut r, &[b, h, t, d]);
    let g = rand_t(&mut r, &[b, h, t, d]);
    let (out_full, ctx_full) = causal_prefix_attention_forward(&q, &k, &v, scale).unwrap();
    let (dq_full, dk_full, dv_full) =
        causal_prefix_attention_backward(&ctx_full, &k, &v, &g, scale).unwrap();

    let mut dk_sum = vec![0.0; b * h * t * d];
    let mut dv_sum = vec![0.0; b * h * t * d];
    let mut outs = Vec::new();
    let mut dqs = Vec::new();
    for (start, len) in [(0, 2), (2, 3), (5, 2)] {
        let qs = q.narrow(2, start, len).unwrap();
        let ks = k.narrow(2, 0, start + len).unwrap();
        let vs = v.narrow(2, 0, start + len).unwrap();
        let gs = g.narrow(2, start, len).unwrap();
        let (out, ctx) = causal_prefix_attention_forward(&qs, &ks, &vs, scale).unwrap();
        let (dq, dk, dv) = causal_prefix_attention_backward(&ctx, &ks, &vs, &gs, scale).unwrap();
        assert_eq!(dk.dims(), &[b, h, start + len, d]);
        let (dkv, dvv) = (vals(&dk), vals(&dv));
        for bh in 0..b * h {
            for j in 0..start + len {
                for c in 0..d {
                    dk_sum[(bh * t + j) * d + c] += dkv[(bh * (start + len) + j) * d + c];
                    dv_sum[(bh * t + j) * d + c] += dvv[(bh * (start + len) + j) * d + c];
                }
            }
        }
        outs.push(out);
        dqs.push(dq);
    }
    let out_cat = Tensor::cat(&outs, 2).unwrap();
    let dq_cat = Tensor::cat(&dqs, 2).unwrap();
    assert_close(&out_cat, &out_full, 1e-14, 1e-14, "segmented out");
    assert_close(&dq_cat, &dq_full, 1e-13, 1e-14, "segmented dq");
    assert_close_vec(&dk_sum, &vals(&dk_full), 1e-13, 1e-14, "summed dk");
    assert_close_vec(&dv_sum, &vals(&dv_full), 1e-13, 1e-14, "summed dv");
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(94);
    let (q, k, v, g) = (
        rand_t(&mut r, &[1, 2, 3, 4]),
        rand_t(&mut r, &[1, 2, 5, 4]),
        rand_t(&mut r, &[1, 2, 5, 4]),
        rand_t(&mut r, &[1, 2, 3, 4]),
    );
    let (o64, c64) = causal_prefix_attention_forward(&q, &k, &v, 0.5).unwrap();
    let (dq64, dk64, dv64) = causal_prefix_attention_backward(&c64, &k, &v, &g, 0.5).unwrap();
    let run = || {
        let (o, c) = causal_prefix_attention_forward(&f32t(&q), &f32t(&k), &f32t(&v), 0.5).unwrap();
        let (dq, dk, dv) =
            causal_prefix_attention_backward(&c, &f32t(&k), &f32t(&v), &f32t(&g), 0.5).unwrap();
        [o, c.lse, dq, dk, dv]
    };
    let a = run();
    assert_close(&a[0], &o64, 1e-5, 1e-6, "out f32");
    assert_close(&a[2], &dq64, 1e-5, 1e-6, "dq f32");
    assert_close(&a[3], &dk64, 1e-5, 1e-6, "dk f32");
    assert_close(&a[4], &dv64, 1e-5, 1e-6, "dv f32");
    for (i, (x, y)) in a.iter().zip(&run()).enumerate() {
        assert_bit_identical(x, y, &format!("output {i}"));
    }
}

#[test]
fn non_contiguous_inputs() {
    // q, k, v sliced out of a fused (B, H, T, 3D) tensor, as a model might do.
    let mut r = rng(95);
    let fused = rand_t(&mut r, &[1, 2, 4, 12]);
    let (q, k, v) = (
        fused.narrow(3, 0, 4).unwrap(),
        fused.narrow(3, 4, 4).unwrap(),
        fused.narrow(3, 8, 4).unwrap(),
    );
    let (out, ctx) = causal_prefix_attention_forward(&q, &k, &v, 0.5).unwrap();
    let (qc, kc, vc) = (
        q.contiguous().unwrap(),
        k.contiguous().unwrap(),
        v.contiguous().unwrap(),
    );
    let (out_c, ctx_c) = causal_prefix_attention_forward(&qc, &kc, &vc, 0.5).unwrap();
    assert_bit_identical(&out, &out_c, "out");
    let g = rand_t(&mut r, &[1, 2, 4, 4]);
    let a = causal_prefix_attention_backward(&ctx, &k, &v, &g, 0.5).unwrap();
    let b = causal_prefix_attention_backward(&ctx_c, &kc, &vc, &g, 0.5).unwrap();
    assert_bit_identical(&a.0, &b.0, "dq");
    assert_bit_identical(&a.1, &b.1, "dk");
    assert_bit_identical(&a.2, &b.2, "dv");
}

#[test]
fn rejects_bad_shapes() {
    let mut r = rng(96);
    let q = rand_t(&mut r, &[1, 2, 4, 4]);
    let short_k = rand_t(&mut r, &[1, 2, 3, 4]);
    assert!(causal_prefix_attention_forward(&q, &short_k, &short_k, 1.0).is_err());
    let k = rand_t(&mut r, &[1, 2, 5, 4]);
    let v = rand_t(&mut r, &[1, 2, 6, 4]);
    assert!(causal_prefix_attention_forward(&q, &k, &v, 1.0).is_err());
}
