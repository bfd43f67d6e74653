use candle_core::{DType, Device, Tensor};
use ops::RopeTable;

use crate::common::*;

const BASE: f64 = 10000.0;

/// Rotate-half RoPE with plain loops: pairs (i, i + D/2), angle (offset + t) * base^(-2i/D).
fn naive_rope(x: &Tensor, offset: usize) -> Tensor {
    let (b, h, s, d) = x.dims4().unwrap();
    let half = d / 2;
    let xv = vals(x);
    let mut y = vec![0.0; xv.len()];
    for row in 0..b * h * s {
        let pos = (offset + row % s) as f64;
        let base_i = row * d;
        for i in 0..half {
            let theta = pos * BASE.powf(-((2 * i) as f64) / d as f64);
            let (x1, x2) = (xv[base_i + i], xv[base_i + i + half]);
            y[base_i + i] = x1 * theta.cos() - x2 * theta.sin();
            y[base_i + i + half] = x2 * theta.cos() + x1 * theta.sin();
        }
    }
    Tensor::from_vec(y, (b, h, s, d), x.device()).unwrap()
}

#[test]
fn forward_matches_references() {
    let mut r = rng(40);
    let table = RopeTable::new(16, 8, BASE, DType::F64, &Device::Cpu).unwrap();
    assert_eq!(table.cos().dims(), &[16, 4]);
    assert_eq!(table.sin().dims(), &[16, 4]);
    let x = rand_t(&mut r, &[2, 3, 5, 8]);
    for offset in [0, 4, 11] {
        let y = table.forward(&x, offset).unwrap();
        assert_close(&y, &naive_rope(&x, offset), 1e-13, 1e-14, "rope vs naive");
        let cos = table
            .cos()
            .narrow(0, offset, 5)
            .unwrap()
            .contiguous()
            .unwrap();
        let sin = table
            .sin()
            .narrow(0, offset, 5)
            .unwrap()
            .contiguous()
            .unwrap();
        let reference = candle_nn::rotary_emb::rope(&x, &cos, &sin).unwrap();
        assert_close(&y, &reference, 1e-14, 1e-14, "rope vs candle_nn");
    }
    assert!(
        table.forward(&x, 12).is_err(),
        "positions past max_len must be rejected"
    );
}

#[test]
fn segment_with_offset_equals_slice_of_full_sequence() {
    let mut r = rng(41);
    let table = RopeTable::new(10, 4, BASE, DType::F64, &Device::Cpu).unwrap();
    let x = rand_t(&mut r, &[1, 2, 10, 4]);
    let full = table.forward(&x, 0).unwrap();
    for (start, len) in [(0, 3), (3, 4), (7, 3)] {
        let seg = table
            .forward(&x.narrow(2, start, len).unwrap(), start)
            .unwrap();
        assert_bit_identical(
            &seg,
            &full.narrow(2, start, len).unwrap().contiguous().unwrap(),
            "segment",
        );
    }
}

#[test]
fn backward_is_inverse_rotation() {
    let mut r = rng(42);
    let table = RopeTable::new(12, 6, BASE, DType::F64, &Device::Cpu).unwrap();
    let x = rand_t(&mut r, &[2, 2, 4, 6]);
    let y = table.forward(&x, 5).unwrap();
    assert_close(
        &table.backward(&y, 5).unwrap(),
        &x,
        1e-14,
        1e-14,
        "backward(forward(x))",
    );
    assert_close(
        &table.forward(&table.backward(&x, 5).unwrap(), 5).unwrap(),
        &x,
        1e-14,
        1e-14,
        "forward(backward(x))",
    );
}

#[test]
fn backward_matches_finite_differences() {
    let mut r = rng(43);
    let table = RopeTable::new(12, 6, BASE, DType::F64, &Device::Cpu).unwrap();
    let inputs = [rand_t(&mut r, &[2, 2, 3, 6])];
    let g = rand_t(&mut r, &[2, 2, 3, 6]);
    for offset in [0, 7] {
        let f = |a: &[Tensor]| dot(&g, &table.forward(&a[0], offset).unwrap());
        let dx = table.backward(&g, offset).unwrap();
        check_grad(&f, &inputs, 0, &dx, "dx");
    }
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(44);
    let t64 = RopeTable::new(8, 4, BASE, DType::F64, &Device::Cpu).unwrap();
    let t32 = RopeTable::new(8, 4, BASE, DType::F32, &Device::Cpu).unwrap();
    let x = rand_t(&mut r, &[1, 2, 3, 4]);
    let y64 = t64.forward(&x, 2).unwrap();
    let y = t32.forward(&f32t(&x), 2).unwrap();
    assert_eq!(y.dtype(), DType::F32);
    assert_close(&y, &y64, 1e-6, 1e-6, "y f32");
    assert_bit_identical(&y, &t32.forward(&f32t(&x), 2).unwrap(), "y");
    assert!(
        t32.forward(&x, 2).is_err(),
        "dtype mismatch must be rejected"
    );
    assert!(RopeTable::new(8, 5, BASE, DType::F32, &Device::Cpu).is_err());
}
