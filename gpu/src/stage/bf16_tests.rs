//! The BF16 fast path of [`GpuStage`] on the emulated GPU: the LM head over a padded vocabulary
//! gives the real rows' loss and gradients bit for bit as the unpadded head does (the emulator's
//! products accumulate in `k` order, where a padded zero row adds an exact 0), the BF16 weight
//! copies follow the FP32 master weights through updates and restores, and the state keeps the real
//! vocabulary and no copies.

use super::*;
use crate::Precision;

/// Vocabulary 97: padded to 128 by [`VOCAB_PADDING`].
const VOCAB: usize = 97;
const C: usize = 32;
const SEGMENTS: [usize; 2] = [3, 5];
const ROWS: usize = 2;

fn shape() -> ModelConfig {
    ModelConfig {
        vocab_size: VOCAB,
        layers: 1,
        d_model: C,
        heads: 2,
        ffn_mult: 2,
        max_seq_len: 8,
        norm_eps: 1e-5,
        ..ModelConfig::default()
    }
}

/// Every parameter of a one-block model held whole, with values from `seed`.
fn params(seed: f32) -> Vec<StageParam> {
    let (v, c, f) = (VOCAB, C, 2 * C);
    let dims: Vec<(&str, Vec<usize>)> = vec![
        ("wte.weight", vec![v, c]),
        ("wpe.weight", vec![8, c]),
        ("h.0.ln_1.weight", vec![c]),
        ("h.0.ln_1.bias", vec![c]),
        ("h.0.attn.c_attn.weight", vec![3 * c, c]),
        ("h.0.attn.c_attn.bias", vec![3 * c]),
        ("h.0.attn.c_proj.weight", vec![c, c]),
        ("h.0.attn.c_proj.bias", vec![c]),
        ("h.0.ln_2.weight", vec![c]),
        ("h.0.ln_2.bias", vec![c]),
        ("h.0.mlp.c_fc.weight", vec![f, c]),
        ("h.0.mlp.c_fc.bias", vec![f]),
        ("h.0.mlp.c_proj.weight", vec![c, f]),
        ("h.0.mlp.c_proj.bias", vec![c]),
        ("ln_f.weight", vec![c]),
        ("ln_f.bias", vec![c]),
        ("lm_head.weight", vec![v, c]),
    ];
    dims.into_iter()
        .enumerate()
        .map(|(p, (name, dims))| {
            let len: usize = dims.iter().product();
            let norm = name.contains("ln_") && name.ends_with("weight");
            let values = (0..len)
                .map(|i| {
                    let x = ((i as f32 + 0.5) * 0.731 + p as f32 * 1.37 + seed).sin();
                    if norm { 1.0 + 0.1 * x } else { 0.2 * x }
                })
                .collect();
            StageParam {
                name: name.to_string(),
                dims,
                values,
            }
        })
        .collect()
}

fn stage(precision: Precision, padding: Option<usize>, seed: f32) -> GpuStage {
    let gpu = Gpu::open(0, precision).unwrap();
    let plan = StagePlan::whole(shape(), SEGMENTS.to_vec());
    let mut s = GpuStage::new(gpu, plan, params(seed)).unwrap();
    if let Some(p) = padding {
        s.set_vocab_padding(p).unwrap();
    }
    s
}

/// One training step of one micro-batch (both segments forward, then backward): the summed loss
/// and the gradients.
fn step(s: &mut GpuStage, n: usize) -> (f64, Vec<NamedTensor>) {
    let scale = 1.0 / (ROWS * 8) as f64;
    s.begin_step(1);
    let mut loss = 0.0;
    for (seg, &len) in SEGMENTS.iter().enumerate() {
        let id =
            |r: usize, t: usize, salt: usize| ((r * 31 + t * 7 + n * 17 + salt) % VOCAB) as u32;
        let start: usize = SEGMENTS[..seg].iter().sum();
        let ids: Vec<u32> = (0..ROWS)
            .flat_map(|r| (0..len).map(move |t| id(r, start + t, 0)))
            .collect();
        let targets: Vec<u32> = (0..ROWS)
            .flat_map(|r| (0..len).map(move |t| id(r, start + t, 5)))
            .collect();
        let out = s
            .forward(
                (0, seg),
                UnitInput::Tokens(&ids),
                Some(&targets),
                scale,
                true,
            )
            .unwrap();
        let UnitOutput::LossSum(l) = out else {
            panic!("a stage holding the whole model ends in the loss")
        };
        loss += l;
    }
    for seg in (0..SEGMENTS.len()).rev() {
        assert_eq!(s.backward((0, seg), None).unwrap(), UnitGrad::None);
    }
    s.finish_gradients().unwrap();
    (loss, s.gradients().unwrap())
}

fn update(s: &mut GpuStage) {
    let decay = WeightDecay {
        rate: 0.1,
        embeddings: true,
    };
    s.apply_update(1e-2, 1.0, decay, (0.9, 0.95, 1e-8)).unwrap();
}

fn bits(t: &[NamedTensor]) -> Vec<(String, Vec<usize>, Vec<u32>)> {
    t.iter()
        .map(|(n, d, v)| {
            (
                n.clone(),
                d.clone(),
                v.iter().map(|x| x.to_bits()).collect(),
            )
        })
        .collect()
}

/// Round to nearest even (what `to_bf16` does; no NaNs here).
fn bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// The head over a vocabulary of 97 padded to 128 rows, against the same stage with no padding
/// (a padding to a multiple of 1): the loss and every gradient bit-identical, over two steps with
/// an update between (the padded copy refreshed too).
#[test]
fn the_padded_head_gives_the_unpadded_loss_and_gradients_bit_for_bit() {
    let mut padded = stage(Precision::Bf16, None, 0.0);
    let mut plain = stage(Precision::Bf16, Some(1), 0.0);
    assert_eq!(padded.head_rows(), 128);
    assert_eq!(plain.head_rows(), VOCAB);
    assert!(
        padded.products().contains("cached-weights"),
        "{}",
        padded.products()
    );
    for n in 0..2 {
        let (lp, gp) = step(&mut padded, n);
        let (lu, gu) = step(&mut plain, n);
        assert_eq!(
            lp.to_bits(),
            lu.to_bits(),
            "step {n}: loss {lp} padded, {lu} not"
        );
        for (a, b) in bits(&gp).iter().zip(bits(&gu)) {
            assert_eq!(a, &b, "step {n}: gradient of {}", b.0);
        }
        update(&mut padded);
        update(&mut plain);
    }
    // The padding is internal: the state has the real vocabulary, and no copies.
    let state = padded.state().unwrap();
    let head = state
        .iter()
        .find(|(n, _, _)| n == "lm_head.weight")
        .unwrap();
    assert_eq!(head.1, vec![VOCAB, C]);
    assert_eq!(head.2.len(), VOCAB * C);
    let names: Vec<_> = state.iter().map(|(n, _, _)| n.clone()).collect();
    let mut want = padded.param_names();
    want.extend(
        padded
            .param_names()
            .iter()
            .flat_map(|n| [format!("optim.m.{n}"), format!("optim.v.{n}")]),
    );
    want.sort();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, want);
    assert_eq!(bits(&state), bits(&plain.state().unwrap()));
    // Too late to change the padding once the buffers are sized.
    assert!(padded.set_vocab_padding(64).is_err());
    assert!(
        stage(Precision::Bf16, None, 0.0)
            .set_vocab_padding(0)
            .is_err()
    );
}

/// The BF16 copies equal the master weights rounded to BF16 (the head's padded rows zero) when
/// built, after each of two updates, and after a restore of other weights: a copy not refreshed
/// would hold the old weights. FP32 and TF32 stages keep none, and the state's bytes count them.
#[test]
fn the_bf16_weight_copies_follow_the_master_weights() {
    let check = |s: &GpuStage, when: &str| {
        let w16 = s.bf16.as_ref().expect("BF16 mode keeps weight copies");
        let words = s.gpu.download(&w16.words).unwrap();
        let values = s.gpu.download(&s.values).unwrap();
        assert_eq!(w16.copies.len(), 5, "four linear weights and the head");
        for &(slot, off) in &w16.copies {
            let sl = &s.slots[slot];
            let want: Vec<u16> = values[sl.offset..sl.offset + sl.len]
                .iter()
                .map(|&x| bf16_bits(x))
                .collect();
            assert_eq!(
                &words[off..off + sl.len],
                &want[..],
                "{when}: copy of {}",
                sl.name
            );
            if sl.name == "lm_head.weight" {
                let pad = &words[off + sl.len..off + 128 * C];
                assert!(pad.iter().all(|&w| w == 0), "{when}: padded rows not zero");
            }
        }
    };
    let mut s = stage(Precision::Bf16, None, 0.0);
    check(&s, "built");
    assert_eq!(
        s.bf16_weight_bytes(),
        2 * (3 * C * C + C * C + 4 * C * C + 128 * C)
    );
    assert_eq!(s.state_bytes(), 16 * s.numel() + s.bf16_weight_bytes());
    for n in 0..2 {
        step(&mut s, n);
        update(&mut s);
        check(&s, &format!("after update {}", n + 1));
    }
    let other = stage(Precision::Bf16, None, 9.0);
    let flat: Vec<f32> = other
        .state()
        .unwrap()
        .into_iter()
        .flat_map(|t| t.2)
        .collect();
    s.load_state(&flat, None, 0).unwrap();
    check(&s, "after a restore");
    for p in [Precision::Fp32, Precision::Tf32] {
        let s = stage(p, None, 0.0);
        assert!(s.bf16.is_none());
        assert_eq!(s.head_rows(), VOCAB);
        assert_eq!(s.state_bytes(), 16 * s.numel());
    }
    let mut gpu = Gpu::open(0, Precision::Bf16).unwrap();
    gpu.set_bf16_path(Bf16Path::Operands);
    let plan = StagePlan::whole(shape(), SEGMENTS.to_vec());
    let s = GpuStage::new(gpu, plan, params(0.0)).unwrap();
    assert!(s.bf16.is_none(), "the operands path keeps no copies");
}

/// The cross-entropy over rows wider than the vocabulary: losses and gradients of the real
/// columns bit-identical to the compact rows', the padded columns set to 0 with the gradient and
/// left alone without.
#[test]
fn the_cross_entropy_reads_only_the_real_columns_of_padded_rows() {
    let gpu = Gpu::open(0, Precision::Bf16).unwrap();
    let (rows, v, ld) = (3, 10, 16);
    let compact: Vec<f32> = (0..rows * v)
        .map(|i| (i as f32 * 0.37).sin() * 3.0)
        .collect();
    let mut wide = vec![7.5f32; rows * ld];
    for r in 0..rows {
        wide[r * ld..r * ld + v].copy_from_slice(&compact[r * v..(r + 1) * v]);
    }
    let targets = gpu.upload(&[1u32, 9, 4]).unwrap();
    for want_grad in [false, true] {
        let (a, b) = (gpu.upload(&compact).unwrap(), gpu.upload(&wide).unwrap());
        let (la, lb): (Buf<f32>, Buf<f32>) = (gpu.zeros(rows).unwrap(), gpu.zeros(rows).unwrap());
        gpu.softmax_cross_entropy(a.ptr(), la.ptr(), targets.ptr(), rows, v, 0.5, want_grad)
            .unwrap();
        gpu.softmax_cross_entropy_rows(
            b.ptr(),
            lb.ptr(),
            targets.ptr(),
            rows,
            (v, ld),
            0.5,
            want_grad,
        )
        .unwrap();
        assert_eq!(gpu.download(&la).unwrap(), gpu.download(&lb).unwrap());
        let (a, b) = (gpu.download(&a).unwrap(), gpu.download(&b).unwrap());
        for r in 0..rows {
            assert_eq!(&b[r * ld..r * ld + v], &a[r * v..(r + 1) * v], "row {r}");
            let pad = if want_grad { 0.0 } else { 7.5 };
            assert!(
                b[r * ld + v..(r + 1) * ld].iter().all(|&x| x == pad),
                "row {r}"
            );
        }
    }
    let l: Buf<f32> = gpu.zeros(1).unwrap();
    let x = gpu.upload(&[0.0f32; 4]).unwrap();
    assert!(
        gpu.softmax_cross_entropy_rows(x.ptr(), l.ptr(), targets.ptr(), 1, (4, 3), 1.0, true)
            .is_err()
    );
}
