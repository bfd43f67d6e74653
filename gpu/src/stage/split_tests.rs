//! The split backward of [`GpuStage`] on the emulated GPU: input halves
//! ([`GpuStage::backward_input`]) and weight halves ([`GpuStage::backward_weight`]) run apart, the
//! weight halves deferred past later units' input halves as `seq1f1b-zb` runs them, give the
//! input gradients and the step's parameter gradients of whole backwards bit for bit — on every
//! kind of stage (first, middle, last, the whole model), in FP32 and on the BF16 fast path (whose
//! weight halves round their output gradients again), with layer and RMS norms, an MLP narrower
//! than the fused QKV (`ffn_mult = 2`), and document masks with positions restarting per document.

use super::*;
use crate::Precision;

const ROWS: usize = 2;
const MICRO_BATCHES: usize = 2;

/// One way of building the stages under test.
#[derive(Clone, Copy, Debug)]
struct Case {
    precision: Precision,
    norm: Norm,
    ffn_mult: usize,
    segments: &'static [usize],
    /// Document masks, positions restarting at each document.
    documents: bool,
}

/// How a step's backwards run: whole, or split with each weight half `lag` input halves late.
#[derive(Clone, Copy, Debug)]
enum Backward {
    Whole,
    Split { lag: usize },
}

fn model(case: Case) -> ModelConfig {
    ModelConfig {
        vocab_size: 40,
        layers: 3,
        d_model: 32,
        heads: 2,
        ffn_mult: case.ffn_mult,
        max_seq_len: case.segments.iter().sum(),
        norm: case.norm,
        norm_eps: 1e-5,
        ..ModelConfig::default()
    }
}

/// Stage `layout` of `case`'s model, with every parameter of it from a fixed rule (norm weights
/// near 1, everything else small).
fn stage(case: Case, layout: StageLayout) -> GpuStage {
    let plan = StagePlan {
        model: model(case),
        layout,
        segments: case.segments.to_vec(),
        longest_segment: None,
    };
    let params = stage_specs(&plan)
        .into_iter()
        .enumerate()
        .map(|(p, spec)| {
            let len: usize = spec.shape.iter().product();
            let norm = spec.name.contains("ln_") && spec.name.ends_with("weight");
            let values = (0..len)
                .map(|i| {
                    let x = ((i as f32 + 0.5) * 0.731 + p as f32 * 1.37).sin();
                    if norm { 1.0 + 0.1 * x } else { 0.2 * x }
                })
                .collect();
            StageParam {
                name: spec.name,
                dims: spec.shape,
                values,
            }
        })
        .collect();
    let mut s = GpuStage::new(Gpu::open(0, case.precision).unwrap(), plan, params).unwrap();
    s.set_reset_positions(case.documents && s.plan.layout.is_first())
        .unwrap();
    s
}

/// Deterministic values in `[-1, 1)`.
fn noise(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919 + seed * 104_729) as f32 * 0.013).sin())
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One training step of `case` on stage `layout`: every unit forward, then the backwards in
/// Seq1F1B's order (micro-batches ascending, segments descending) run as `how`. Returns every
/// unit's input gradient (in that order, as bits) and the step's summed gradient (bits).
fn run_step(case: Case, layout: StageLayout, how: Backward) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut s = stage(case, layout.clone());
    let (c, vocab, segments) = (32, 40, case.segments);
    let seq: usize = segments.iter().sum();
    s.begin_step(MICRO_BATCHES);
    for mb in 0..MICRO_BATCHES {
        if case.documents {
            let docs = vec![vec![0, 3, seq - 2], vec![0, 5]];
            s.set_documents(mb, ops::DocumentMask::new(docs).unwrap())
                .unwrap();
        }
        for (seg, &len) in segments.iter().enumerate() {
            let n = ROWS * len;
            let ids: Vec<u32> = (0..n)
                .map(|i| ((i * 13 + mb * 7 + seg) % vocab) as u32)
                .collect();
            let targets: Vec<u32> = ids.iter().map(|&t| (t * 3 + 1) % vocab as u32).collect();
            let hidden = noise(n * c, 10 * mb + seg);
            let input = match layout.is_first() {
                true => UnitInput::Tokens(&ids),
                false => UnitInput::Hidden(&hidden),
            };
            let targets = layout.is_last().then_some(&targets[..]);
            let scale = 1.0 / (MICRO_BATCHES * ROWS * seq) as f64;
            s.forward((mb, seg), input, targets, scale, true).unwrap();
        }
    }
    let order: Vec<(usize, usize)> = (0..MICRO_BATCHES)
        .flat_map(|mb| (0..segments.len()).rev().map(move |seg| (mb, seg)))
        .collect();
    let d_out = |(mb, seg): (usize, usize)| noise(ROWS * segments[seg] * c, 100 + 10 * mb + seg);
    let mut dx = Vec::new();
    let mut record = |g: UnitGrad| match g {
        UnitGrad::None => dx.push(Vec::new()),
        UnitGrad::Hidden(v) => dx.push(bits(&v)),
        UnitGrad::Kept(_) => panic!("no device link was joined"),
    };
    let mut waiting = std::collections::VecDeque::new();
    for &u in &order {
        let d = (!layout.is_last()).then(|| d_out(u));
        match how {
            Backward::Whole => record(s.backward(u, d.as_deref()).unwrap()),
            Backward::Split { lag } => {
                record(s.backward_input(u, d.as_deref()).unwrap());
                waiting.push_back(u);
                if waiting.len() > lag {
                    s.backward_weight(waiting.pop_front().unwrap()).unwrap();
                }
            }
        }
    }
    if !waiting.is_empty() {
        // Not complete before every weight half: the input halves added no gradient.
        let e = s.finish_gradients().unwrap_err();
        assert!(
            matches!(
                e,
                GpuError::Model(model::ModelError::IncompleteGradients { .. })
            ),
            "{e}"
        );
    }
    while let Some(u) = waiting.pop_front() {
        s.backward_weight(u).unwrap();
    }
    assert_eq!(s.activation_bytes(), 0, "every unit freed");
    s.finish_gradients().unwrap();
    (dx, bits(&s.gradient_vector().unwrap()))
}

#[test]
fn split_backwards_give_the_whole_backwards_gradients_bit_for_bit() {
    let cases = [
        Case {
            precision: Precision::Fp32,
            norm: Norm::LayerNorm,
            ffn_mult: 4,
            segments: &[5, 3],
            documents: false,
        },
        Case {
            precision: Precision::Bf16,
            norm: Norm::RmsNorm,
            ffn_mult: 2,
            segments: &[2, 3, 3],
            documents: true,
        },
    ];
    for case in cases {
        for (stage, stages, layers) in [(0, 1, 0..3), (0, 3, 0..1), (1, 3, 1..2), (2, 3, 2..3)] {
            let layout = StageLayout {
                stage,
                stages,
                layers,
            };
            let whole = run_step(case, layout.clone(), Backward::Whole);
            assert!(
                whole.1.iter().any(|&b| b != 0),
                "no gradient: the test is blind"
            );
            for lag in [0, 2] {
                let split = run_step(case, layout.clone(), Backward::Split { lag });
                let what = format!("{case:?}, stage {stage} of {stages}, lag {lag}");
                assert!(split.0 == whole.0, "input gradients differ: {what}");
                assert!(split.1 == whole.1, "parameter gradients differ: {what}");
            }
        }
    }
}

/// The halves keep their order on the device too (the model's rules): a weight half before its
/// input half, or twice, is refused with the split-order error naming the unit, and changes
/// nothing.
#[test]
fn a_weight_half_before_its_input_half_or_twice_is_refused() {
    let case = Case {
        precision: Precision::Fp32,
        norm: Norm::LayerNorm,
        ffn_mult: 4,
        segments: &[4],
        documents: false,
    };
    let layout = StageLayout {
        stage: 0,
        stages: 1,
        layers: 0..1,
    };
    let mut s = stage(case, layout);
    s.begin_step(1);
    let ids: Vec<u32> = (0..ROWS as u32 * 4).collect();
    let targets: Vec<u32> = ids.iter().map(|t| (t + 1) % 40).collect();
    s.forward((0, 0), UnitInput::Tokens(&ids), Some(&targets), 0.1, true)
        .unwrap();
    let split_order = |e: GpuError| match e {
        GpuError::Model(model::ModelError::SplitOrder { problem, .. }) => problem,
        other => panic!("not a split-order error: {other}"),
    };
    assert_eq!(
        split_order(s.backward_weight((0, 0)).unwrap_err()),
        model::SplitOrder::WeightBeforeInput
    );
    assert_eq!(s.backward_input((0, 0), None).unwrap(), UnitGrad::None);
    assert!(
        s.activation_bytes() > 0,
        "the unit waits for its weight half"
    );
    s.backward_weight((0, 0)).unwrap();
    assert_eq!(s.activation_bytes(), 0);
    assert!(s.backward_weight((0, 0)).is_err(), "a weight half twice");
    s.finish_gradients().unwrap();
}
