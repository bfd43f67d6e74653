use candle_core::{Tensor, Var};
use ops::{linear_backward, linear_forward};

use crate::common::*;

/// y[n][o] = sum_i x[n][i] w[o][i] + b[o], with plain loops.
fn naive_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let (n, din) = x.dims2().unwrap();
    let dout = w.dims2().unwrap().0;
    let (xv, wv) = (vals(x), vals(w));
    let bv = b.map(vals);
    let mut y = vec![0.0; n * dout];
    for r in 0..n {
        for o in 0..dout {
            let mut acc = bv.as_ref().map_or(0.0, |b| b[o]);
            for i in 0..din {
                acc += xv[r * din + i] * wv[o * din + i];
            }
            y[r * dout + o] = acc;
        }
    }
    Tensor::from_vec(y, (n, dout), x.device()).unwrap()
}

#[test]
fn forward_matches_naive() {
    let mut r = rng(1);
    let (x, w, b) = (
        rand_t(&mut r, &[5, 4]),
        rand_t(&mut r, &[3, 4]),
        rand_t(&mut r, &[3]),
    );
    let (y, _) = linear_forward(&x, &w, Some(&b)).unwrap();
    assert_close(
        &y,
        &naive_linear(&x, &w, Some(&b)),
        1e-14,
        1e-14,
        "y with bias",
    );
    let (y, _) = linear_forward(&x, &w, None).unwrap();
    assert_close(
        &y,
        &naive_linear(&x, &w, None),
        1e-14,
        1e-14,
        "y without bias",
    );
}

#[test]
fn backward_matches_finite_differences() {
    let mut r = rng(2);
    let inputs = [
        rand_t(&mut r, &[5, 4]),
        rand_t(&mut r, &[3, 4]),
        rand_t(&mut r, &[3]),
    ];
    let g = rand_t(&mut r, &[5, 3]);
    let f = |a: &[Tensor]| dot(&g, &linear_forward(&a[0], &a[1], Some(&a[2])).unwrap().0);
    let (_, ctx) = linear_forward(&inputs[0], &inputs[1], Some(&inputs[2])).unwrap();
    let (dx, grads) = linear_backward(&ctx, &inputs[1], &g, true).unwrap();
    check_grad(&f, &inputs, 0, &dx, "dx");
    check_grad(&f, &inputs, 1, &grads.dw, "dw");
    check_grad(&f, &inputs, 2, grads.db.as_ref().unwrap(), "db");

    let (_, grads) = linear_backward(&ctx, &inputs[1], &g, false).unwrap();
    assert!(grads.db.is_none());
}

#[test]
fn backward_matches_candle_autograd() {
    let mut r = rng(3);
    let x = Var::from_tensor(&rand_t(&mut r, &[6, 5])).unwrap();
    let w = Var::from_tensor(&rand_t(&mut r, &[2, 5])).unwrap();
    let b = Var::from_tensor(&rand_t(&mut r, &[2])).unwrap();
    let g = rand_t(&mut r, &[6, 2]);
    let y = x
        .matmul(&w.t().unwrap())
        .unwrap()
        .broadcast_add(&b)
        .unwrap();
    let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
    let (y2, ctx) = linear_forward(&x, &w, Some(&b)).unwrap();
    assert_close(&y2, &y, 1e-14, 1e-14, "y");
    let (dx, lg) = linear_backward(&ctx, &w, &g, true).unwrap();
    assert_close(&dx, grads.get(&x).unwrap(), 1e-13, 1e-13, "dx");
    assert_close(&lg.dw, grads.get(&w).unwrap(), 1e-13, 1e-13, "dw");
    assert_close(
        lg.db.as_ref().unwrap(),
        grads.get(&b).unwrap(),
        1e-13,
        1e-13,
        "db",
    );
}

#[test]
fn f32_matches_f64_and_is_deterministic() {
    let mut r = rng(4);
    let (x, w, b) = (
        rand_t(&mut r, &[7, 6]),
        rand_t(&mut r, &[5, 6]),
        rand_t(&mut r, &[5]),
    );
    let g = rand_t(&mut r, &[7, 5]);
    let (y64, c64) = linear_forward(&x, &w, Some(&b)).unwrap();
    let (dx64, g64) = linear_backward(&c64, &w, &g, true).unwrap();
    let run = || {
        let (y, c) = linear_forward(&f32t(&x), &f32t(&w), Some(&f32t(&b))).unwrap();
        let (dx, gr) = linear_backward(&c, &f32t(&w), &f32t(&g), true).unwrap();
        (y, dx, gr.dw, gr.db.unwrap())
    };
    let (y, dx, dw, db) = run();
    assert_eq!(y.dtype(), candle_core::DType::F32);
    assert_close(&y, &y64, 1e-5, 1e-5, "y f32");
    assert_close(&dx, &dx64, 1e-5, 1e-5, "dx f32");
    assert_close(&dw, &g64.dw, 1e-5, 1e-5, "dw f32");
    assert_close(&db, g64.db.as_ref().unwrap(), 1e-5, 1e-5, "db f32");
    let (y2, dx2, dw2, db2) = run();
    assert_bit_identical(&y, &y2, "y");
    assert_bit_identical(&dx, &dx2, "dx");
    assert_bit_identical(&dw, &dw2, "dw");
    assert_bit_identical(&db, &db2, "db");
}

#[test]
fn rejects_bad_shapes() {
    let mut r = rng(5);
    let (x, w) = (rand_t(&mut r, &[5, 4]), rand_t(&mut r, &[3, 5]));
    assert!(linear_forward(&x, &w, None).is_err());
    let x3 = rand_t(&mut r, &[2, 5, 4]);
    assert!(linear_forward(&x3, &rand_t(&mut r, &[3, 4]), None).is_err());
}

/// The two halves of the backward give the whole backward's gradients bit for bit (f32, the
/// dtype training runs), whether or not `dy` arrives contiguous; a weight half given an output
/// gradient of other rows than the saved input is refused.
#[test]
fn the_input_and_weight_halves_are_the_whole_backward() {
    let mut r = rng(3);
    let f32s = |t: Tensor| t.to_dtype(candle_core::DType::F32).unwrap();
    let (x, w, b) = (
        f32s(rand_t(&mut r, &[7, 5])),
        f32s(rand_t(&mut r, &[6, 5])),
        f32s(rand_t(&mut r, &[6])),
    );
    let (_, ctx) = linear_forward(&x, &w, Some(&b)).unwrap();
    // A transposed view: not contiguous.
    let dy = f32s(rand_t(&mut r, &[6, 7])).t().unwrap();
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let (dx, g) = linear_backward(&ctx, &w, &dy, true).unwrap();
    let dx_half = ops::linear_backward_input(&ctx, &w, &dy).unwrap();
    let g_half = ops::linear_backward_weight(&ctx, &dy, true).unwrap();
    assert_eq!(bits(&dx), bits(&dx_half));
    assert_eq!(bits(&g.dw), bits(&g_half.dw));
    assert_eq!(
        bits(g.db.as_ref().unwrap()),
        bits(g_half.db.as_ref().unwrap())
    );
    assert!(
        ops::linear_backward_weight(&ctx, &dy, false)
            .unwrap()
            .db
            .is_none()
    );
    let short = dy.narrow(0, 0, 6).unwrap();
    let e = ops::linear_backward_weight(&ctx, &short, true).unwrap_err();
    assert!(e.to_string().contains("7 rows but dy has 6"), "{e}");
}
