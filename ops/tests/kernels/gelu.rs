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
    let (y, _) = gelu_forward(&x, None).unwrap();
    let expected: Vec<f64> = vals(&x).into_iter().map(naive_gelu).collect();
    assert_close_vec(&vals(&y), &expected, 1e-14, 1e-15, "gelu");
}

#[test]
fn backward_matches_finite_differences() {
    let mut r = rng(21);
    let inputs = [rand_scaled(&mut r, &[3, 7], 4.0)];
    let g = rand_t(&mut r, &[3, 7]);
    let f = |a: &[Tensor]| dot(&g, &gelu_forward(&a[0], None).unwrap().0);
    let (_, ctx) = gelu_forward(&inputs[0], None).unwrap();
    let (dx, dbias) = gelu_backward(&ctx, &g).unwrap();
    assert!(dbias.is_none());
    check_grad(&f, &inputs, 0, &dx, "dx");
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(22);
    let (x, g) = (rand_scaled(&mut r, &[4, 5], 3.0), rand_t(&mut r, &[4, 5]));
    let b = rand_t(&mut r, &[5]);
    let (y64, c64) = gelu_forward(&x, Some(&b)).unwrap();
    let (dx64, db64) = gelu_backward(&c64, &g).unwrap();
    let run = || {
        let (y, c) = gelu_forward(&f32t(&x), Some(&f32t(&b))).unwrap();
        let (dx, db) = gelu_backward(&c, &f32t(&g)).unwrap();
        (y, dx, db.unwrap())
    };
    let (y, dx, db) = run();
    assert_close(&y, &y64, 1e-5, 1e-6, "y f32");
    assert_close(&dx, &dx64, 1e-5, 1e-6, "dx f32");
    assert_close(&db, db64.as_ref().unwrap(), 1e-5, 1e-6, "dbias f32");
    let (y2, dx2, db2) = run();
    assert_bit_identical(&y, &y2, "y");
    assert_bit_identical(&dx, &dx2, "dx");
    assert_bit_identical(&db, &db2, "dbias");
}

#[test]
fn bias_forward_equals_gelu_of_the_sum() {
    let mut r = rng(23);
    let (x, b) = (rand_scaled(&mut r, &[6, 5], 3.0), rand_t(&mut r, &[5]));
    let (y, _) = gelu_forward(&x, Some(&b)).unwrap();
    let (y_sum, _) = gelu_forward(&x.broadcast_add(&b).unwrap(), None).unwrap();
    assert_close(&y, &y_sum, 1e-15, 1e-15, "gelu(x + b)");
}

#[test]
fn bias_backward_matches_finite_differences() {
    let mut r = rng(24);
    let inputs = [rand_scaled(&mut r, &[7, 3], 3.0), rand_t(&mut r, &[3])];
    let g = rand_t(&mut r, &[7, 3]);
    let f = |a: &[Tensor]| dot(&g, &gelu_forward(&a[0], Some(&a[1])).unwrap().0);
    let (_, ctx) = gelu_forward(&inputs[0], Some(&inputs[1])).unwrap();
    let (dx, dbias) = gelu_backward(&ctx, &g).unwrap();
    check_grad(&f, &inputs, 0, &dx, "dx");
    check_grad(&f, &inputs, 1, &dbias.unwrap(), "dbias");
    assert!(gelu_forward(&inputs[0], Some(&g)).is_err(), "bias shape");
}

/// Over 2^16 elements the rows are split into several parallel tasks whose bias-gradient partial
/// sums are added in task order.
#[test]
fn bias_gradient_over_several_tasks_matches_finite_differences() {
    let mut r = rng(25);
    let inputs = [rand_scaled(&mut r, &[30_000, 3], 3.0), rand_t(&mut r, &[3])];
    let g = rand_t(&mut r, &[30_000, 3]);
    let f = |a: &[Tensor]| dot(&g, &gelu_forward(&a[0], Some(&a[1])).unwrap().0);
    let (_, ctx) = gelu_forward(&inputs[0], Some(&inputs[1])).unwrap();
    let (dx, dbias) = gelu_backward(&ctx, &g).unwrap();
    check_grad(&f, &inputs, 1, &dbias.unwrap(), "dbias");
    // dx is that of GELU applied to the sum.
    let summed = inputs[0].broadcast_add(&inputs[1]).unwrap();
    let (_, ctx) = gelu_forward(&summed, None).unwrap();
    assert_bit_identical(&dx, &gelu_backward(&ctx, &g).unwrap().0, "dx");
}
