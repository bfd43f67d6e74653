use candle_core::Tensor;
use ops::{softmax_last_dim, softmax_last_dim_backward};

use crate::common::*;

#[test]
fn forward_matches_references() {
    let mut r = rng(30);
    let x = rand_scaled(&mut r, &[2, 3, 5], 5.0);
    let y = softmax_last_dim(&x).unwrap();
    let xv = vals(&x);
    let mut expected = Vec::new();
    for row in xv.chunks(5) {
        let z: f64 = row.iter().map(|v| v.exp()).sum();
        expected.extend(row.iter().map(|v| v.exp() / z));
    }
    assert_close_vec(&vals(&y), &expected, 1e-13, 1e-15, "softmax");
    let reference = candle_nn::ops::softmax_last_dim(&f32t(&x)).unwrap();
    assert_close(
        &softmax_last_dim(&f32t(&x)).unwrap(),
        &reference,
        1e-5,
        1e-7,
        "vs candle_nn",
    );
}

#[test]
fn forward_is_stable_for_large_logits() {
    let x = Tensor::new(
        &[[1000.0f32, 1001.0, 999.0], [-1e4, 0.0, -1e4]],
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let y = vals(&softmax_last_dim(&x).unwrap());
    assert!(y.iter().all(|v| v.is_finite()));
    let e = [(-1.0f64).exp(), 1.0, (-2.0f64).exp()];
    let z: f64 = e.iter().sum();
    assert_close_vec(
        &y[..3],
        &[e[0] / z, e[1] / z, e[2] / z],
        1e-6,
        1e-7,
        "row 0",
    );
    assert_close_vec(&y[3..], &[0.0, 1.0, 0.0], 0.0, 1e-7, "row 1");
}

#[test]
fn backward_matches_finite_differences() {
    let mut r = rng(31);
    let inputs = [rand_scaled(&mut r, &[2, 3, 5], 3.0)];
    let g = rand_t(&mut r, &[2, 3, 5]);
    let f = |a: &[Tensor]| dot(&g, &softmax_last_dim(&a[0]).unwrap());
    let y = softmax_last_dim(&inputs[0]).unwrap();
    let dx = softmax_last_dim_backward(&y, &g).unwrap();
    check_grad(&f, &inputs, 0, &dx, "dx");
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(32);
    let (x, g) = (rand_scaled(&mut r, &[4, 9], 3.0), rand_t(&mut r, &[4, 9]));
    let dx64 = softmax_last_dim_backward(&softmax_last_dim(&x).unwrap(), &g).unwrap();
    let run = || {
        let y = softmax_last_dim(&f32t(&x)).unwrap();
        let dx = softmax_last_dim_backward(&y, &f32t(&g)).unwrap();
        (y, dx)
    };
    let (y, dx) = run();
    assert_close(&dx, &dx64, 1e-5, 1e-6, "dx f32");
    let (y2, dx2) = run();
    assert_bit_identical(&y, &y2, "y");
    assert_bit_identical(&dx, &dx2, "dx");
}
