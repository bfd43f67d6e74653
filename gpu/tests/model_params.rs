//! A GPU stage holds exactly the parameters the model names for its layers (`model::params`):
//! the list is not re-spelled in `gpu`, so a norm without biases, a parameter of another stage or
//! a missing one are refused when the stage is built, naming the parameter. Checked on the
//! emulated GPU (`--features emulate`).
#![cfg(feature = "emulate")]

use gpu::stage::{GpuStage, StageParam, StagePlan};
use gpu::{Gpu, Precision};
use model::params::component_params;
use model::{ModelConfig, Norm, Position, StageLayout};

fn plan(norm: Norm) -> StagePlan {
    let model = ModelConfig {
        vocab_size: 32,
        layers: 2,
        d_model: 16,
        heads: 1,
        ffn_mult: 2,
        max_seq_len: 8,
        norm,
        ..ModelConfig::default()
    };
    // The first of two stages: the embeddings and block 0.
    let layout = StageLayout {
        stage: 0,
        stages: 2,
        layers: 0..1,
    };
    StagePlan {
        model,
        layout,
        segments: vec![4, 4],
        longest_segment: None,
    }
}

/// The model's parameters of `plan`'s stage, every value 0.01.
fn params(plan: &StagePlan) -> Vec<StageParam> {
    plan.layout
        .components()
        .into_iter()
        .flat_map(|c| component_params(&plan.model, c))
        .map(|s| StageParam {
            name: s.name,
            values: vec![0.01; s.shape.iter().product()],
            dims: s.shape,
        })
        .collect()
}

fn build(plan: &StagePlan, params: Vec<StageParam>) -> Result<GpuStage, String> {
    let gpu = Gpu::open(0, Precision::Fp32).map_err(|e| e.to_string())?;
    GpuStage::new(gpu, plan.clone(), params).map_err(|e| e.to_string())
}

#[test]
fn a_stage_takes_exactly_the_models_parameters_of_its_layers() {
    let layer_norm = plan(Norm::LayerNorm);
    let stage = build(&layer_norm, params(&layer_norm)).unwrap();
    assert_eq!(stage.param_names()[..2], ["wte.weight", "wpe.weight"]);

    // RMS norm has no norm biases: the layer-norm list does not fit it.
    let rms = plan(Norm::RmsNorm);
    build(&rms, params(&rms)).unwrap();
    let err = build(&rms, params(&layer_norm)).err().unwrap();
    assert!(
        err.contains("h.0.ln_1.bias") && err.contains("not one of this stage's"),
        "{err}"
    );

    // A parameter of the other stage.
    let mut extra = params(&layer_norm);
    extra.push(StageParam {
        name: "lm_head.weight".into(),
        dims: vec![32, 16],
        values: vec![0.0; 32 * 16],
    });
    let err = build(&layer_norm, extra).err().unwrap();
    assert!(err.contains("lm_head.weight"), "{err}");

    // A missing one, and one of the wrong shape.
    let mut missing = params(&layer_norm);
    missing.retain(|p| p.name != "h.0.mlp.c_fc.bias");
    let err = build(&layer_norm, missing).err().unwrap();
    assert!(err.contains("h.0.mlp.c_fc.bias is missing"), "{err}");
    let mut wrong = params(&layer_norm);
    wrong[0].dims = vec![16, 32];
    let err = build(&layer_norm, wrong).err().unwrap();
    assert!(err.contains("wte.weight has dims [16, 32]"), "{err}");

    // RoPE models have no CUDA kernels.
    let mut rope = plan(Norm::LayerNorm);
    rope.model.position = Position::Rope;
    let err = build(&rope, params(&rope)).err().unwrap();
    assert!(err.contains("learned positions only"), "{err}");
}
