use candle_core::{DType, Device, Tensor};
use ops::{cross_entropy_forward_backward, cross_entropy_loss};

use crate::common::*;

fn naive_loss(logits: &Tensor, targets: &Tensor) -> f64 {
    let (n, v) = logits.dims2().unwrap();
    let (lv, tv) = (vals(logits), targets.to_vec1::<u32>().unwrap());
    (0..n)
        .map(|r| {
            let row = &lv[r * v..(r + 1) * v];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lse - row[tv[r] as usize]
        })
        .sum()
}

#[test]
fn forward_matches_references() {
    let mut r = rng(60);
    let logits = rand_scaled(&mut r, &[6, 11], 4.0);
    let targets = rand_ids(&mut r, 6, 11);
    let expected = naive_loss(&logits, &targets);
    let loss = cross_entropy_loss(&logits, &targets).unwrap();
    assert!(
        (loss - expected).abs() <= 1e-13 * expected.abs(),
        "{loss} vs {expected}"
    );
    let (loss2, dl) = cross_entropy_forward_backward(&logits, &targets, 1.0).unwrap();
    assert_eq!(loss.to_bits(), loss2.to_bits());
    assert_eq!(dl.dims(), &[6, 11]);
    let mean = candle_nn::loss::cross_entropy(&logits, &targets)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!((mean * 6.0 - expected).abs() <= 1e-12 * expected.abs());
}

#[test]
fn gradient_matches_finite_differences() {
    let mut r = rng(61);
    let inputs = [rand_scaled(&mut r, &[5, 7], 3.0)];
    let targets = rand_ids(&mut r, 5, 7);
    let scale = 0.37;
    let f = |a: &[Tensor]| scale * cross_entropy_loss(&a[0], &targets).unwrap();
    let (_, dl) = cross_entropy_forward_backward(&inputs[0], &targets, scale).unwrap();
    check_grad(&f, &inputs, 0, &dl, "dlogits");
    // The gradient is grad_scale * (softmax - onehot): each row sums to zero.
    for row in vals(&dl).chunks(7) {
        assert!(row.iter().sum::<f64>().abs() < 1e-15);
    }
}

#[test]
fn f32_matches_f64_and_is_stable() {
    let mut r = rng(63);
    let logits = rand_scaled(&mut r, &[4, 9], 3.0);
    let targets = rand_ids(&mut r, 4, 9);
    let (l64, d64) = cross_entropy_forward_backward(&logits, &targets, 0.5).unwrap();
    let (l32, d32) = cross_entropy_forward_backward(&f32t(&logits), &targets, 0.5).unwrap();
    assert!((l32 - l64).abs() < 1e-5 * l64.abs());
    assert_close(&d32, &d64, 1e-5, 1e-6, "dlogits f32");
    // Huge logits: no overflow.
    let big = Tensor::new(
        &[[1000.0f32, 0.0, -1000.0], [5000.0, 5000.0, 0.0]],
        &Device::Cpu,
    )
    .unwrap();
    let t = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
    let (l, d) = cross_entropy_forward_backward(&big, &t, 1.0).unwrap();
    assert!((l - (2000.0 + 2f64.ln())).abs() < 1e-3, "{l}");
    assert!(vals(&d).iter().all(|v| v.is_finite()));
}

#[test]
fn rejects_bad_targets() {
    let logits = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
    let bad = Tensor::new(&[0u32, 3], &Device::Cpu).unwrap();
    assert!(cross_entropy_loss(&logits, &bad).is_err());
    let short = Tensor::new(&[0u32], &Device::Cpu).unwrap();
    assert!(cross_entropy_forward_backward(&logits, &short, 1.0).is_err());
    let wrong_dtype = Tensor::new(&[0i64, 1], &Device::Cpu).unwrap();
    assert!(cross_entropy_loss(&logits, &wrong_dtype).is_err());
}
