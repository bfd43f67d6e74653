use candle_core::{DType, Tensor};
use ops::{
    cross_entropy_forward_backward, cross_entropy_loss, linear_backward, linear_forward,
    lm_head_loss, lm_head_loss_forward_backward,
};

use crate::common::*;

#[test]
fn gradients_match_finite_differences() {
    let mut r = rng(100);
    let (n, c, v) = (7, 4, 9);
    let inputs = [
        rand_scaled(&mut r, &[n, c], 1.5),
        rand_scaled(&mut r, &[v, c], 1.5),
    ];
    let targets = rand_ids(&mut r, n, v as u32);
    let scale = 0.3;
    let f = |a: &[Tensor]| scale * lm_head_loss(&a[0], &a[1], &targets, 3).unwrap();
    let (_, g) = lm_head_loss_forward_backward(&inputs[0], &inputs[1], &targets, scale, 3).unwrap();
    check_grad(&f, &inputs, 0, &g.dh, "dh");
    check_grad(&f, &inputs, 1, &g.dw, "dw");
}

/// The fused head equals the unfused linear layer + cross-entropy (loss bit for bit: same rows of
/// logits, same row arithmetic), for any chunking.
#[test]
fn matches_linear_then_cross_entropy_for_any_chunking() {
    let mut r = rng(101);
    let (n, c, v) = (10, 5, 13);
    let h = f32t(&rand_scaled(&mut r, &[n, c], 2.0));
    let w = f32t(&rand_scaled(&mut r, &[v, c], 2.0));
    let targets = rand_ids(&mut r, n, v as u32);
    let (logits, ctx) = linear_forward(&h, &w, None).unwrap();
    let (l_ref, d_logits) = cross_entropy_forward_backward(&logits, &targets, 0.1).unwrap();
    assert_eq!(
        l_ref.to_bits(),
        cross_entropy_loss(&logits, &targets).unwrap().to_bits()
    );
    let (dh_ref, g_ref) = linear_backward(&ctx, &w, &d_logits, false).unwrap();
    let mut reference = None;
    for chunk in [0, 1, 3, 4, 10, 64] {
        let (l, g) = lm_head_loss_forward_backward(&h, &w, &targets, 0.1, chunk).unwrap();
        assert_eq!(g.dh.dtype(), DType::F32);
        assert_eq!(l.to_bits(), l_ref.to_bits(), "loss with chunk {chunk}");
        let l_only = lm_head_loss(&h, &w, &targets, chunk).unwrap();
        assert_eq!(
            l_only.to_bits(),
            l_ref.to_bits(),
            "loss-only with chunk {chunk}"
        );
        assert_close(
            &g.dh,
            &dh_ref,
            1e-5,
            1e-7,
            &format!("dh with chunk {chunk}"),
        );
        assert_close(
            &g.dw,
            &g_ref.dw,
            1e-5,
            1e-7,
            &format!("dw with chunk {chunk}"),
        );
        // A given chunking is deterministic.
        let (_, again) = lm_head_loss_forward_backward(&h, &w, &targets, 0.1, chunk).unwrap();
        assert_bit_identical(&g.dw, &again.dw, "dw rerun");
        if chunk == 0 {
            reference = Some(g.dh);
        } else {
            // dh rows do not depend on the chunking.
            assert_bit_identical(&g.dh, reference.as_ref().unwrap(), "dh vs one chunk");
        }
    }
}

#[test]
fn rejects_bad_shapes() {
    let mut r = rng(102);
    let h = rand_t(&mut r, &[3, 4]);
    let w = rand_t(&mut r, &[5, 3]);
    let targets = rand_ids(&mut r, 3, 5);
    assert!(lm_head_loss(&h, &w, &targets, 0).is_err(), "width");
    let w = rand_t(&mut r, &[5, 4]);
    assert!(
        lm_head_loss(&h, &w, &rand_ids(&mut r, 2, 5), 0).is_err(),
        "rows"
    );
    let out_of_range = Tensor::new(&[0u32, 5, 1], h.device()).unwrap();
    assert!(lm_head_loss(&h, &w, &out_of_range, 0).is_err(), "target");
}
