//! The step profiler (`gpu::profile`, `seqpipe gpu bench --profile`) on the emulated GPU: a
//! pipeline-shaped step of a whole GPT (two micro-batches of two segments, the update included)
//! is covered by its categories — every launch categorised, every product named by its layer and
//! pass with the counts the model implies, the categories' time summing to nearly all of the
//! step's wall time — and profiling changes no result.
#![cfg(feature = "emulate")]

use std::time::Instant;

use gpu::profile::Group;
use gpu::stage::{GpuStage, StageParam, StagePlan, UnitInput, UnitOutput};
use gpu::{Gpu, Precision, Profile};
use model::ModelConfig;
use model::params::WeightDecay;

// Small: the emulator runs a few milliseconds per thread block, and the gradient norm alone
// launches 256 blocks per tensor.
const LAYERS: usize = 1;
const C: usize = 16;
const VOCAB: usize = 29;
const SEGMENTS: [usize; 2] = [4, 4];
const MICRO_BATCHES: usize = 2;
/// Sequences per micro-batch.
const B: usize = 1;

fn shape() -> ModelConfig {
    ModelConfig {
        vocab_size: VOCAB,
        layers: LAYERS,
        d_model: C,
        heads: 1,
        ffn_mult: 2,
        max_seq_len: 8,
        norm_eps: 1e-5,
        ..ModelConfig::default()
    }
}

/// Every parameter of the model, deterministic values.
fn params() -> Vec<StageParam> {
    let (v, c, f) = (VOCAB, C, 2 * C);
    let mut dims: Vec<(String, Vec<usize>)> = vec![
        ("wte.weight".into(), vec![v, c]),
        ("wpe.weight".into(), vec![8, c]),
    ];
    for l in 0..LAYERS {
        for (name, d) in [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.c_attn.weight", vec![3 * c, c]),
            ("attn.c_attn.bias", vec![3 * c]),
            ("attn.c_proj.weight", vec![c, c]),
            ("attn.c_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.c_fc.weight", vec![f, c]),
            ("mlp.c_fc.bias", vec![f]),
            ("mlp.c_proj.weight", vec![c, f]),
            ("mlp.c_proj.bias", vec![c]),
        ] {
            dims.push((format!("h.{l}.{name}"), d));
        }
    }
    dims.push(("ln_f.weight".into(), vec![c]));
    dims.push(("ln_f.bias".into(), vec![c]));
    dims.push(("lm_head.weight".into(), vec![v, c]));
    dims.into_iter()
        .enumerate()
        .map(|(p, (name, dims))| {
            let len: usize = dims.iter().product();
            let norm = name.contains("ln_") && name.ends_with("weight");
            let values = (0..len)
                .map(|i| {
                    let x = ((i as f32 + 0.5) * 0.731 + p as f32 * 1.37).sin();
                    if norm { 1.0 + 0.1 * x } else { 0.2 * x }
                })
                .collect();
            StageParam { name, dims, values }
        })
        .collect()
}

fn stage(precision: Precision) -> GpuStage {
    let plan = StagePlan::whole(shape(), SEGMENTS.to_vec());
    GpuStage::new(Gpu::open(0, precision).unwrap(), plan, params()).unwrap()
}

/// Token ids of micro-batch `mb`, segment `seg` (`B` rows of the segment) and their targets.
fn tokens(mb: usize, seg: usize) -> (Vec<u32>, Vec<u32>) {
    let n = B * SEGMENTS[seg];
    let id = |i: usize| ((i * 31 + mb * 7 + seg * 13) % VOCAB) as u32;
    (
        (0..n).map(id).collect(),
        (0..n).map(|i| id(i + 1)).collect(),
    )
}

/// One training step in the pipeline's shape: every micro-batch's segments forward in order and
/// backward in reverse, then the gradient norm and the update. Returns the summed loss.
fn step(m: &mut GpuStage) -> f64 {
    m.begin_step(MICRO_BATCHES);
    let mut loss = 0.0;
    for mb in 0..MICRO_BATCHES {
        for seg in 0..SEGMENTS.len() {
            let (ids, targets) = tokens(mb, seg);
            let out = m
                .forward(
                    (mb, seg),
                    UnitInput::Tokens(&ids),
                    Some(&targets),
                    0.01,
                    true,
                )
                .unwrap();
            let UnitOutput::LossSum(l) = out else {
                panic!("a whole model ends in the loss")
            };
            loss += l;
        }
        for seg in (0..SEGMENTS.len()).rev() {
            m.backward((mb, seg), None).unwrap();
        }
    }
    m.finish_gradients().unwrap();
    let sums = m.grad_sums_of_squares().unwrap();
    let norm = sums.iter().map(|(_, s)| s).sum::<f64>().sqrt();
    let clip = (1.0 / norm).min(1.0);
    let decay = WeightDecay {
        rate: 0.1,
        embeddings: true,
    };
    m.apply_update(1e-3, clip, decay, (0.9, 0.95, 1e-8))
        .unwrap();
    loss
}

/// Profiles `steps` steps; returns the profile and the wall time the test itself measured around
/// them.
fn profiled(m: &mut GpuStage, steps: usize) -> (Profile, f64) {
    m.gpu().profile_begin().unwrap();
    let started = Instant::now();
    for _ in 0..steps {
        step(m);
    }
    let p = m.gpu().profile_end(steps).unwrap();
    (p, started.elapsed().as_secs_f64() * 1e3 / steps as f64)
}

fn calls(p: &Profile, category: &str) -> f64 {
    p.categories
        .iter()
        .find(|r| r.category == category)
        .map_or(0.0, |r| r.calls)
}

/// One test, run in order: the emulator runs one launch at a time per process, and a test waiting
/// for another's launches would see that wait as a gap in its step.
#[test]
fn profiles_of_the_emulated_gpu() {
    the_profile_of_a_pipeline_shaped_step_covers_it_with_named_categories();
    profiling_changes_no_result_and_stops_when_ended();
}

fn the_profile_of_a_pipeline_shaped_step_covers_it_with_named_categories() {
    for precision in [Precision::Bf16, Precision::Fp32] {
        let mut m = stage(precision);
        let (p, wall_ms) = profiled(&mut m, 1);
        let table = p.table();
        // Every launch categorised: no unknown kernel, no unlabelled product.
        assert_eq!(p.unknown_pct, 0.0, "{precision:?}:\n{table}");
        assert!(
            p.categories
                .iter()
                .all(|r| r.group != Group::Unknown && !r.category.contains("unlabelled")),
            "{precision:?}:\n{table}"
        );
        // The products by layer and pass, with the counts the model implies: per unit and
        // layer one forward product each, c_attn's backward in three planes (three dx, three dw).
        let units = (MICRO_BATCHES * SEGMENTS.len()) as f64;
        let per_layer = units * LAYERS as f64;
        for (category, want) in [
            ("gemm attn.c_attn fwd", per_layer),
            ("gemm attn.c_attn dx", 3.0 * per_layer),
            ("gemm attn.c_attn dw", 3.0 * per_layer),
            ("gemm attn.c_proj fwd", per_layer),
            ("gemm attn.c_proj dx", per_layer),
            ("gemm attn.c_proj dw", per_layer),
            ("gemm mlp.c_fc fwd", per_layer),
            ("gemm mlp.c_fc dx", per_layer),
            ("gemm mlp.c_fc dw", per_layer),
            ("gemm mlp.c_proj fwd", per_layer),
            ("gemm mlp.c_proj dx", per_layer),
            ("gemm mlp.c_proj dw", per_layer),
            // One head chunk per unit (4 rows).
            ("gemm lm_head fwd", units),
            ("gemm lm_head dx", units),
            ("gemm lm_head dw", units),
            ("attention fwd", per_layer),
            ("attention bwd dq", per_layer),
            ("attention bwd dk dv", per_layer),
            ("attention bwd delta", per_layer),
            ("layernorm fwd", 2.0 * per_layer + units),
            ("embedding fwd", units),
            ("cross-entropy", units),
            ("gelu fwd (+bias)", per_layer),
            ("gelu bwd", per_layer),
            // The tree sums two micro-batches' gradients once.
            ("gradient accumulation", 1.0),
        ] {
            assert_eq!(
                calls(&p, category),
                want,
                "{category} ({precision:?}):\n{table}"
            );
        }
        let gemms: f64 = p
            .categories
            .iter()
            .filter(|r| r.group == Group::Gemm)
            .map(|r| r.calls)
            .sum();
        // Per unit and layer 7 products of c_attn and 3 of each other linear layer; 3 of the head.
        assert_eq!(gemms, 16.0 * per_layer + 3.0 * units, "{table}");
        for category in ["adamw", "grad norm (sums of squares)", "layernorm bwd"] {
            assert!(calls(&p, category) > 0.0, "{category}:\n{table}");
        }
        let casts = calls(&p, "cast to bf16") + calls(&p, "cast to bf16 (weight copies)");
        assert_eq!(casts > 0.0, precision == Precision::Bf16, "{table}");
        // Launches: every kernel and product, and nothing else.
        let launched: f64 = p
            .categories
            .iter()
            .filter(|r| !matches!(r.group, Group::Memory | Group::Sync))
            .map(|r| r.calls)
            .sum();
        assert_eq!(p.launches, launched, "{table}");
        assert!(
            p.ops > p.launches,
            "copies and memsets are timed too:\n{table}"
        );
        // The categories cover the step: on the emulator every operation is synchronous, so their
        // time sums to the step's wall time less the host's own bookkeeping.
        let sum: f64 = p.categories.iter().map(|r| r.gpu_ms).sum();
        assert!((sum - p.gpu_busy_ms).abs() < 1e-6 * p.gpu_busy_ms.max(1.0));
        assert!(
            p.gpu_busy_ms <= p.wall_ms * 1.0001 && p.wall_ms <= wall_ms * 1.0001,
            "busy {} ms, profiled wall {} ms, measured {wall_ms} ms",
            p.gpu_busy_ms,
            p.wall_ms
        );
        assert!(
            p.gpu_busy_ms >= 0.75 * p.wall_ms,
            "the categories cover only {:.1}% of the step ({precision:?}):\n{table}",
            100.0 * p.gpu_busy_ms / p.wall_ms
        );
    }
}

fn profiling_changes_no_result_and_stops_when_ended() {
    let (mut plain, mut timed) = (stage(Precision::Bf16), stage(Precision::Bf16));
    let losses = (step(&mut plain), {
        timed.gpu().profile_begin().unwrap();
        step(&mut timed)
    });
    let p = timed.gpu().profile_end(1).unwrap();
    assert!(p.launches > 0.0);
    assert!(!timed.gpu().profiling());
    assert_eq!(losses.0, losses.1);
    let bits = |m: &GpuStage| -> Vec<(String, Vec<u32>)> {
        m.state()
            .unwrap()
            .into_iter()
            .map(|(n, _, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
            .collect()
    };
    assert_eq!(bits(&plain), bits(&timed), "profiling changed the state");
    // Ended: ending again is an error naming the cause.
    let err = timed.gpu().profile_end(1).unwrap_err().to_string();
    assert!(err.contains("profile_begin"), "{err}");
}
