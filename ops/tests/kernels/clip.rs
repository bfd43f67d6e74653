use candle_core::{Device, Tensor};
use ops::{clip_coefficient, global_norm, sum_of_squares};

use crate::common::*;

#[test]
fn sum_of_squares_and_global_norm() {
    let a = Tensor::new(&[[3.0f32, 4.0], [1.0, -2.0]], &Device::Cpu).unwrap();
    assert_eq!(sum_of_squares(&a).unwrap(), 30.0);
    let b = Tensor::new(&[1.0f64, 2.0, 2.0], &Device::Cpu).unwrap();
    assert_eq!(sum_of_squares(&b).unwrap(), 9.0);
    // Non-contiguous input.
    assert_eq!(sum_of_squares(&a.t().unwrap()).unwrap(), 30.0);
    // Narrowed view (non-zero start offset).
    assert_eq!(sum_of_squares(&a.narrow(0, 1, 1).unwrap()).unwrap(), 5.0);
    assert_eq!(global_norm([30.0, 9.0, 25.0]), 8.0);
    assert_eq!(global_norm(std::iter::empty()), 0.0);
}

#[test]
fn sum_of_squares_is_deterministic_and_precise() {
    let mut r = rng(70);
    let t = rand_t(&mut r, &[100, 37]);
    let expected: f64 = vals(&t).iter().map(|v| v * v).sum();
    assert_eq!(sum_of_squares(&t).unwrap(), expected);
    let t32 = f32t(&t);
    let exp32: f64 = vals(&t32).iter().map(|v| v * v).sum();
    assert_eq!(
        sum_of_squares(&t32).unwrap(),
        exp32,
        "f32 is accumulated in f64"
    );
    assert_eq!(
        sum_of_squares(&t32).unwrap().to_bits(),
        sum_of_squares(&t32).unwrap().to_bits()
    );
}

#[test]
fn clip_coefficient_cases() {
    // Clipping off.
    assert_eq!(clip_coefficient(10.0, 0.0), 1.0);
    assert_eq!(clip_coefficient(10.0, -1.0), 1.0);
    // Below the threshold: no clipping.
    assert_eq!(clip_coefficient(0.5, 1.0), 1.0);
    assert_eq!(clip_coefficient(0.0, 1.0), 1.0);
    // Above: max_norm / (total + 1e-6).
    assert_eq!(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
    assert_eq!(clip_coefficient(2.0, 1.0), 1.0 / (2.0 + 1e-6));
    // Exactly at the threshold the 1e-6 makes it (barely) clip.
    let c = clip_coefficient(1.0, 1.0);
    assert!(c < 1.0 && c > 1.0 - 2e-6);
    // Infinite norm clips everything to zero.
    assert_eq!(clip_coefficient(f64::INFINITY, 1.0), 0.0);
}
