use candle_core::{DType, Device, Tensor};
use ops::{AdamW, AdamWConfig};

use crate::common::*;

fn scalar(v: f64) -> Tensor {
    Tensor::new(&[v], &Device::Cpu).unwrap()
}

#[test]
fn default_config() {
    let c = AdamWConfig::default();
    assert_eq!((c.beta1, c.beta2, c.eps), (0.9, 0.95, 1e-8));
}

/// Hand-computed two-step example, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, lr = 0.1, wd = 0.01,
/// p0 = 1, g1 = 0.5, g2 = -0.25. Per step t:
///   p <- p - lr*wd*p
///   m <- b1*m + (1-b1)*g ;  v <- b2*v + (1-b2)*g^2
///   p <- p - lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)
/// Step 1: p = 1 - 0.001 = 0.999; m = 0.05, v = 0.0125; m_hat = 0.5, v_hat = 0.25;
///         p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.89900000199999996...
/// Step 2: p = 0.899000002 * 0.999 = 0.898101001998...; m = 0.045 - 0.025 = 0.02,
///         v = 0.011875 + 0.003125 = 0.015; m_hat = 0.02/0.19 = 2/19, v_hat = 0.015/0.0975 = 2/13;
///         p = 0.898101001998 - 0.1 * (2/19) / (sqrt(2/13) + 1e-8) = 0.87126405787382739...
#[test]
fn hand_computed_two_steps() {
    let mut opt = AdamW::new(AdamWConfig::default());
    let p0 = scalar(1.0);
    opt.begin_step();
    let p1 = opt.update("w", &p0, &scalar(0.5), 1.0, 0.1, 0.01).unwrap();
    let v1 = vals(&p1)[0];
    assert!((v1 - 0.899_000_002).abs() < 1e-15, "{v1}");
    let mom = &opt.moments["w"];
    assert!((vals(&mom.m)[0] - 0.05).abs() < 1e-16);
    assert!((vals(&mom.v)[0] - 0.0125).abs() < 1e-16);
    opt.begin_step();
    let p2 = opt
        .update("w", &p1, &scalar(-0.25), 1.0, 0.1, 0.01)
        .unwrap();
    let v2 = vals(&p2)[0];
    assert!((v2 - 0.871_264_057_873_827_4).abs() < 1e-15, "{v2}");
    let mom = &opt.moments["w"];
    assert!((vals(&mom.m)[0] - 0.02).abs() < 1e-16);
    assert!((vals(&mom.v)[0] - 0.015).abs() < 1e-16);
    assert_eq!(opt.step, 2);
}

/// Element-wise reference implementation of the same formula.
#[test]
fn matches_naive_reference_over_several_steps() {
    let mut r = rng(80);
    let cfg = AdamWConfig {
        beta1: 0.8,
        beta2: 0.99,
        eps: 1e-6,
    };
    let mut opt = AdamW::new(cfg.clone());
    let mut p = rand_t(&mut r, &[3, 4]);
    let mut q = rand_t(&mut r, &[5]);
    let (mut pn, mut m, mut v) = (vals(&p), vec![0.0; 12], vec![0.0; 12]);
    let (lr, wd) = (0.05, 0.1);
    for t in 1..=4 {
        let g = rand_t(&mut r, &[3, 4]);
        let gq = rand_t(&mut r, &[5]);
        opt.begin_step();
        p = opt.update("p", &p, &g, 1.0, lr, wd).unwrap();
        q = opt.update("q", &q, &gq, 1.0, lr, 0.0).unwrap();
        for (i, gi) in vals(&g).into_iter().enumerate() {
            pn[i] -= lr * wd * pn[i];
            m[i] = cfg.beta1 * m[i] + (1.0 - cfg.beta1) * gi;
            v[i] = cfg.beta2 * v[i] + (1.0 - cfg.beta2) * gi * gi;
            let mh = m[i] / (1.0 - cfg.beta1.powi(t));
            let vh = v[i] / (1.0 - cfg.beta2.powi(t));
            pn[i] -= lr * mh / (vh.sqrt() + cfg.eps);
        }
        assert_close_vec(&vals(&p), &pn, 1e-13, 1e-15, "param");
    }
    assert_eq!(opt.moments.len(), 2);
    assert_eq!(q.dims(), &[5]);
}

#[test]
fn f32_params_and_determinism() {
    let mut r = rng(81);
    let p = f32t(&rand_t(&mut r, &[4, 3]));
    let g = f32t(&rand_t(&mut r, &[4, 3]));
    let run = || {
        let mut opt = AdamW::new(AdamWConfig::default());
        opt.begin_step();
        let p1 = opt.update("p", &p, &g, 1.0, 1e-3, 0.1).unwrap();
        opt.begin_step();
        opt.update("p", &p1, &g, 1.0, 1e-3, 0.1).unwrap()
    };
    let a = run();
    assert_eq!(a.dtype(), DType::F32);
    assert_bit_identical(&a, &run(), "p");
}

#[test]
fn rejects_misuse() {
    let mut opt = AdamW::new(AdamWConfig::default());
    assert!(
        opt.update("p", &scalar(1.0), &scalar(1.0), 1.0, 0.1, 0.0)
            .is_err(),
        "update before begin_step"
    );
    opt.begin_step();
    let p = Tensor::zeros(3, DType::F64, &Device::Cpu).unwrap();
    let g2 = Tensor::zeros(2, DType::F64, &Device::Cpu).unwrap();
    assert!(
        opt.update("p", &p, &g2, 1.0, 0.1, 0.0).is_err(),
        "grad shape"
    );
    opt.update("p", &p, &p, 1.0, 0.1, 0.0).unwrap();
    assert!(
        opt.update("p", &g2, &g2, 1.0, 0.1, 0.0).is_err(),
        "moment shape"
    );
}

/// The gradient scale (the clipping coefficient) is applied inside the update.
#[test]
fn grad_scale_equals_a_scaled_gradient() {
    let mut r = rng(83);
    let (p, g) = (rand_t(&mut r, &[4, 3]), rand_t(&mut r, &[4, 3]));
    let mut fused = AdamW::new(AdamWConfig::default());
    let mut plain = AdamW::new(AdamWConfig::default());
    fused.begin_step();
    plain.begin_step();
    let a = fused.update("p", &p, &g, 0.25, 1e-2, 0.1).unwrap();
    let b = plain
        .update("p", &p, &g.affine(0.25, 0.0).unwrap(), 1.0, 1e-2, 0.1)
        .unwrap();
    assert_bit_identical(&a, &b, "param");
    assert_bit_identical(&fused.moments["p"].v, &plain.moments["p"].v, "v");
}
