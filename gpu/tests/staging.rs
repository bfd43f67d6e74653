//! With NCCL links, a stage's state copies to the host must not allocate pinned memory during a
//! step (`cuMemHostAlloc` can stall behind a pending NCCL transfer): joining the links reserves
//! the staging buffers. Checked on the emulated GPU (`--features emulate`), whose staging pool
//! follows the same policy and counts its allocations.
#![cfg(feature = "emulate")]

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use gpu::nccl::{Abort, LinkId};
use gpu::stage::{GpuStage, Side, StageParam, StagePlan};
use gpu::{Gpu, Precision};
use model::{ModelConfig, StageLayout};

/// A middle stage holding block 0 of a tiny GPT (no embeddings, no head).
fn stage() -> GpuStage {
    let (c, f) = (16, 32);
    let model = ModelConfig {
        vocab_size: 32,
        layers: 1,
        d_model: c,
        heads: 1,
        ffn_mult: f / c,
        max_seq_len: 8,
        norm_eps: 1e-5,
        ..ModelConfig::default()
    };
    // The middle one of three stages: neither the embeddings nor the head.
    let layout = StageLayout {
        stage: 1,
        stages: 3,
        layers: 0..1,
    };
    let plan = StagePlan {
        model,
        layout,
        segments: vec![4, 4],
        longest_segment: None,
    };
    let dims: Vec<(&str, Vec<usize>)> = vec![
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
    ];
    let params = dims
        .into_iter()
        .map(|(name, dims)| StageParam {
            name: format!("h.0.{name}"),
            values: vec![0.01; dims.iter().product()],
            dims,
        })
        .collect();
    let gpu = Gpu::open(0, Precision::Fp32).unwrap();
    GpuStage::new(gpu, plan, params).unwrap()
}

#[test]
fn joining_device_links_reserves_the_state_staging_so_a_step_allocates_none() {
    let mut first = stage();
    let mut second = stage();
    let ids = [LinkId::new().unwrap(), LinkId::new().unwrap()];
    let abort = || Abort::from(Arc::new(AtomicBool::new(false)));
    let timeout = Duration::from_secs(120);
    let joined = std::thread::spawn(move || {
        second.join_link(Side::Prev, ids, timeout, abort()).unwrap();
        second
    });
    first.join_link(Side::Next, ids, timeout, abort()).unwrap();
    let _second = joined.join().unwrap();

    let reserved = first.staging_allocations();
    assert!(
        reserved > 0,
        "joining the links allocated no staging buffer"
    );
    // The state copies of steps: the parameters alone (before the optimizer has stepped), then
    // parameters and both moments, two in flight at once (a checkpoint and a peer snapshot).
    let params = first.state().unwrap();
    assert!(!params.is_empty());
    let numel: usize = params.iter().map(|(_, _, v)| v.len()).sum();
    let zeros = vec![0.0f32; numel];
    first
        .load_state(&vec![0.5f32; numel], Some((&zeros, &zeros)), 1)
        .unwrap();
    for _ in 0..3 {
        let a = first.begin_state_download().unwrap();
        let b = first.begin_state_download().unwrap();
        let (a, b) = (a.wait().unwrap(), b.wait().unwrap());
        assert_eq!(a.len(), 3 * params.len());
        assert_eq!(a, b);
    }
    assert_eq!(
        first.staging_allocations(),
        reserved,
        "a state copy after the links were joined allocated staging buffers"
    );
}
