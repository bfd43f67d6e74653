use candle_core::Tensor;
use ops::{layer_norm_backward, layer_norm_forward, rms_norm_backward, rms_norm_forward};

use crate::common::*;

const EPS: f64 = 1e-5;

/// Row-wise LayerNorm / RMSNorm with plain loops.
fn naive_norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, rms: bool) -> Tensor {
    let (n, c) = x.dims2().unwrap();
    let (xv, wv) = (vals(x), vals(w));
    let bv = b.map(vals);
    let mut y = vec![0.0; n * c];
    for r in 0..n {
        let row = &xv[r * c..(r + 1) * c];
        let mean = if rms {
            0.0
        } else {
            row.iter().sum::<f64>() / c as f64
        };
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + EPS).sqrt();
        for i in 0..c {
            y[r * c + i] = (row[i] - mean) * rstd * wv[i] + bv.as_ref().map_or(0.0, |b| b[i]);
        }
    }
    Tensor::from_vec(y, (n, c), x.device()).unwrap()
}

#[test]
fn layer_norm_forward_matches_references() {
    let mut r = rng(10);
    let x = rand_scaled(&mut r, &[4, 6], 3.0);
    let (w, b) = (rand_t(&mut r, &[6]), rand_t(&mut r, &[6]));
    let (y, ctx) = layer_norm_forward(&x, &w, Some(&b), EPS).unwrap();
    assert_close(&y, &naive_norm(&x, &w, Some(&b), false), 1e-13, 1e-13, "y");
    assert_eq!(ctx.rstd.dims(), &[4]);
    assert_eq!(ctx.mean.as_ref().unwrap().dims(), &[4]);
    let (y, _) = layer_norm_forward(&x, &w, None, EPS).unwrap();
    assert_close(
        &y,
        &naive_norm(&x, &w, None, false),
        1e-13,
        1e-13,
        "y no bias",
    );
    // candle-nn's (no-backward) fused kernel, in f32.
    let (y32, _) = layer_norm_forward(&f32t(&x), &f32t(&w), Some(&f32t(&b)), EPS).unwrap();
    let reference =
        candle_nn::ops::layer_norm(&f32t(&x), &f32t(&w), &f32t(&b), EPS as f32).unwrap();
    assert_close(&y32, &reference, 1e-5, 1e-5, "y vs candle_nn");
}

#[test]
fn layer_norm_backward_matches_finite_differences() {
    let mut r = rng(11);
    let inputs = [
        rand_scaled(&mut r, &[4, 6], 2.0),
        rand_t(&mut r, &[6]),
        rand_t(&mut r, &[6]),
    ];
    let g = rand_t(&mut r, &[4, 6]);
    let f = |a: &[Tensor]| {
        dot(
            &g,
            &layer_norm_forward(&a[0], &a[1], Some(&a[2]), EPS)
                .unwrap()
                .0,
        )
    };
    let (_, ctx) = layer_norm_forward(&inputs[0], &inputs[1], Some(&inputs[2]), EPS).unwrap();
    let (dx, grads) = layer_norm_backward(&ctx, &inputs[1], &g, true).unwrap();
    check_grad(&f, &inputs, 0, &dx, "dx");
    check_grad(&f, &inputs, 1, &grads.dweight, "dweight");
    check_grad(&f, &inputs, 2, grads.dbias.as_ref().unwrap(), "dbias");
    // Without bias.
    let f = |a: &[Tensor]| dot(&g, &layer_norm_forward(&a[0], &a[1], None, EPS).unwrap().0);
    let (_, ctx) = layer_norm_forward(&inputs[0], &inputs[1], None, EPS).unwrap();
    let (dx, grads) = layer_norm_backward(&ctx, &inputs[1], &g, false).unwrap();
    assert!(grads.dbias.is_none());
    check_grad(&f, &inputs[..2], 0, &dx, "dx no bias");
    check_grad(&f, &inputs[..2], 1, &grads.dweight, "dweight no bias");
}

#[test]
fn rms_norm_forward_matches_references() {
    let mut r = rng(12);
    let x = rand_scaled(&mut r, &[4, 6], 3.0);
    let w = rand_t(&mut r, &[6]);
    let (y, ctx) = rms_norm_forward(&x, &w, EPS).unwrap();
    assert_close(&y, &naive_norm(&x, &w, None, true), 1e-13, 1e-13, "y");
    assert_eq!(ctx.rstd.dims(), &[4]);
    assert!(ctx.mean.is_none());
    let (y32, _) = rms_norm_forward(&f32t(&x), &f32t(&w), EPS).unwrap();
    let reference = candle_nn::ops::rms_norm(&f32t(&x), &f32t(&w), EPS as f32).unwrap();
    assert_close(&y32, &reference, 1e-5, 1e-5, "y vs candle_nn");
}

#[test]
fn rms_norm_backward_matches_finite_differences() {
    let mut r = rng(13);
    let inputs = [rand_scaled(&mut r, &[4, 6], 2.0), rand_t(&mut r, &[6])];
    let g = rand_t(&mut r, &[4, 6]);
    let f = |a: &[Tensor]| dot(&g, &rms_norm_forward(&a[0], &a[1], EPS).unwrap().0);
    let (_, ctx) = rms_norm_forward(&inputs[0], &inputs[1], EPS).unwrap();
    let (dx, grads) = rms_norm_backward(&ctx, &inputs[1], &g).unwrap();
    assert!(grads.dbias.is_none());
    check_grad(&f, &inputs, 0, &dx, "dx");
    check_grad(&f, &inputs, 1, &grads.dweight, "dweight");
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(14);
    let (x, w, b, g) = (
        rand_scaled(&mut r, &[5, 8], 2.0),
        rand_t(&mut r, &[8]),
        rand_t(&mut r, &[8]),
        rand_t(&mut r, &[5, 8]),
    );
    let (_, c64) = layer_norm_forward(&x, &w, Some(&b), EPS).unwrap();
    let (dx64, g64) = layer_norm_backward(&c64, &w, &g, true).unwrap();
    let (_, r64) = rms_norm_forward(&x, &w, EPS).unwrap();
    let (rdx64, rg64) = rms_norm_backward(&r64, &w, &g).unwrap();
    let run = || {
        let (y, c) = layer_norm_forward(&f32t(&x), &f32t(&w), Some(&f32t(&b)), EPS).unwrap();
        let (dx, gr) = layer_norm_backward(&c, &f32t(&w), &f32t(&g), true).unwrap();
        let (ry, rc) = rms_norm_forward(&f32t(&x), &f32t(&w), EPS).unwrap();
        let (rdx, rgr) = rms_norm_backward(&rc, &f32t(&w), &f32t(&g)).unwrap();
        [y, dx, gr.dweight, gr.dbias.unwrap(), ry, rdx, rgr.dweight]
    };
    let a = run();
    assert_close(&a[1], &dx64, 1e-4, 1e-5, "ln dx f32");
    assert_close(&a[2], &g64.dweight, 1e-4, 1e-5, "ln dweight f32");
    assert_close(
        &a[3],
        g64.dbias.as_ref().unwrap(),
        1e-4,
        1e-5,
        "ln dbias f32",
    );
    assert_close(&a[5], &rdx64, 1e-4, 1e-5, "rms dx f32");
    assert_close(&a[6], &rg64.dweight, 1e-4, 1e-5, "rms dweight f32");
    let b2 = run();
    for (i, (p, q)) in a.iter().zip(&b2).enumerate() {
        assert_bit_identical(p, q, &format!("output {i}"));
    }
}

/// Over 2^16 elements the rows are split into several parallel tasks whose weight/bias gradient
/// partial sums are added in task order.
#[test]
fn parameter_gradients_over_several_tasks_match_finite_differences() {
    let mut r = rng(15);
    let (n, c) = (22_000, 3);
    let inputs = [
        rand_scaled(&mut r, &[n, c], 2.0),
        rand_t(&mut r, &[c]),
        rand_t(&mut r, &[c]),
    ];
    let g = rand_t(&mut r, &[n, c]);
    let f = |a: &[Tensor]| {
        dot(
            &g,
            &layer_norm_forward(&a[0], &a[1], Some(&a[2]), EPS)
                .unwrap()
                .0,
        )
    };
    let (_, ctx) = layer_norm_forward(&inputs[0], &inputs[1], Some(&inputs[2]), EPS).unwrap();
    let (_, grads) = layer_norm_backward(&ctx, &inputs[1], &g, true).unwrap();
    check_grad(&f, &inputs, 1, &grads.dweight, "dweight");
    check_grad(&f, &inputs, 2, grads.dbias.as_ref().unwrap(), "dbias");
}
