use candle_core::Tensor;
use ops::{gelu_backward, gelu_forward};

use crate::common::*;

fn naive_gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

#[test]
fn forward_matches_formula() {
    let mut r = rng(20);
    let x = rand_scaled(&mut r, &[3, 7], 4.0);
    let (y, _) = gelu_forward(&x).unwrap();
    let expected: Vec<f64> = vals(&x).into_iter().map(naive_gelu).collect();
    assert_close_vec(&vals(&y), &expected, 1e-14, 1e-15, "gelu");
}

#[test]
fn backward_matches_finite_differences() {
    let mut r = rng(21);
    let inputs = [rand_scaled(&mut r, &[3, 7], 4.0)];
    let g = rand_t(&mut r, &[3, 7]);
    let f = |a: &[Tensor]| dot(&g, &gelu_forward(&a[0]).unwrap().0);
    let (_, ctx) = gelu_forward(&inputs[0]).unwrap();
    let dx = gelu_backward(&ctx, &g).unwrap();
    check_grad(&f, &inputs, 0, &dx, "dx");
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(22);
    let (x, g) = (rand_scaled(&mut r, &[4, 5], 3.0), rand_t(&mut r, &[4, 5]));
    let (y64, c64) = gelu_forward(&x).unwrap();
    let dx64 = gelu_backward(&c64, &g).unwrap();
    let run = || {
        let (y, c) = gelu_forward(&f32t(&x)).unwrap();
        let dx = gelu_backward(&c, &f32t(&g)).unwrap();
        (y, dx)
    };
    let (y, dx) = run();
    assert_close(&y, &y64, 1e-5, 1e-6, "y f32");
    assert_close(&dx, &dx64, 1e-5, 1e-6, "dx f32");
    let (y2, dx2) = run();
    assert_bit_identical(&y, &y2, "y");
    assert_bit_identical(&dx, &dx2, "dx");
}
