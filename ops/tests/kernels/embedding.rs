use candle_core::{Device, Tensor};
use ops::{embedding_backward, embedding_forward};

use crate::common::*;

#[test]
fn forward_matches_naive() {
    let mut r = rng(50);
    let table = rand_t(&mut r, &[7, 3]);
    let ids = Tensor::new(&[3u32, 0, 6, 3], &Device::Cpu).unwrap();
    let y = embedding_forward(&ids, &table).unwrap();
    let tv = vals(&table);
    let expected: Vec<f64> = [3usize, 0, 6, 3]
        .iter()
        .flat_map(|&i| tv[i * 3..i * 3 + 3].to_vec())
        .collect();
    assert_eq!(y.dims(), &[4, 3]);
    assert_eq!(vals(&y), expected);
}

#[test]
fn backward_matches_finite_differences_with_repeated_ids() {
    let mut r = rng(51);
    let ids = Tensor::new(&[2u32, 4, 2, 0, 2, 4], &Device::Cpu).unwrap();
    let inputs = [rand_t(&mut r, &[5, 3])];
    let g = rand_t(&mut r, &[6, 3]);
    let f = |a: &[Tensor]| dot(&g, &embedding_forward(&ids, &a[0]).unwrap());
    let dtable = embedding_backward(&ids, &g, 5).unwrap();
    check_grad(&f, &inputs, 0, &dtable, "dtable");
}

#[test]
fn backward_sums_in_index_order_and_is_deterministic() {
    let mut r = rng(52);
    let ids = rand_ids(&mut r, 40, 6);
    let g = f32t(&rand_t(&mut r, &[40, 5]));
    let d1 = embedding_backward(&ids, &g, 6).unwrap();
    // Reference: sequential f32 accumulation in index order.
    let (idv, gv) = (
        ids.to_vec1::<u32>().unwrap(),
        g.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    let mut expected = [0f32; 6 * 5];
    for (n, &i) in idv.iter().enumerate() {
        for c in 0..5 {
            expected[i as usize * 5 + c] += gv[n * 5 + c];
        }
    }
    let got = d1.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_bit_identical(
        &d1,
        &embedding_backward(&ids, &g, 6).unwrap(),
        "determinism",
    );
}

#[test]
fn rejects_out_of_range_ids() {
    let table = Tensor::zeros((4, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
    let bad = Tensor::new(&[1u32, 4], &Device::Cpu).unwrap();
    assert!(embedding_forward(&bad, &table).is_err());
    let max = Tensor::new(&[u32::MAX], &Device::Cpu).unwrap();
    assert!(embedding_forward(&max, &table).is_err());
    let dy = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(embedding_backward(&bad, &dy, 4).is_err());
}
