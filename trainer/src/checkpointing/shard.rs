//! What a stage's checkpoint shard holds: its parameters under their global names and AdamW's
//! moments as `optim.m.<name>` / `optim.v.<name>`; and the conversion between candle tensors and the
//! checkpoint crate's raw [`TensorData`].

use candle_core::{DType, Device, Tensor};
use checkpoint::{Dtype, TensorData};
use ops::adamw::{AdamW, Moments};

use crate::model::{ModelError, Stage};

/// Name of AdamW's first moment of parameter `name`.
pub fn m_name(name: &str) -> String {
    format!("optim.m.{name}")
}

/// Name of AdamW's second moment of parameter `name`.
pub fn v_name(name: &str) -> String {
    format!("optim.v.{name}")
}

/// A consistent copy of the stage's state: parameters, then first and second moments, in canonical
/// order. Candle tensors are immutable and every update makes new ones, so this copies no data: the
/// snapshot stays valid while training goes on.
pub fn snapshot(stage: &Stage, optimizer: &AdamW) -> Vec<(String, Tensor)> {
    let mut out: Vec<(String, Tensor)> = stage
        .params()
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    for (name, _) in stage.params().iter() {
        if let Some(Moments { m, v }) = optimizer.moments.get(name) {
            out.push((m_name(name), m.clone()));
            out.push((v_name(name), v.clone()));
        }
    }
    out
}

/// `params`, followed by their AdamW moments' names when `moments`.
pub fn with_moments(params: &[String], moments: bool) -> Vec<String> {
    let mut names = params.to_vec();
    if moments {
        names.extend(params.iter().flat_map(|n| [m_name(n), v_name(n)]));
    }
    names
}

pub fn to_tensor_data(t: &Tensor) -> candle_core::Result<TensorData> {
    let flat = t.flatten_all()?;
    let (dtype, data): (Dtype, Vec<u8>) = match t.dtype() {
        DType::F32 => (
            Dtype::F32,
            flat.to_vec1::<f32>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        DType::F64 => (
            Dtype::F64,
            flat.to_vec1::<f64>()?
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "checkpointing {other:?} tensors is not supported"
            )));
        }
    };
    Ok(TensorData {
        dtype,
        shape: t.dims().to_vec(),
        data: data.into(),
    })
}

/// Raw bytes back into a candle tensor.
pub fn from_tensor_data(d: &TensorData) -> candle_core::Result<Tensor> {
    match d.dtype {
        Dtype::F32 => Tensor::from_vec(
            d.data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect::<Vec<_>>(),
            d.shape.as_slice(),
            &Device::Cpu,
        ),
        Dtype::F64 => Tensor::from_vec(
            d.data
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect::<Vec<_>>(),
            d.shape.as_slice(),
            &Device::Cpu,
        ),
        other => Err(candle_core::Error::Msg(format!(
            "cannot load a {other:?} tensor into the model (expected F32 or F64)"
        ))),
    }
}

/// Puts restored tensors into the stage and the optimizer. Every parameter must be present; moments
/// are required when `optimizer_step > 0`.
pub fn restore(
    stage: &mut Stage,
    optimizer: &mut AdamW,
    tensors: Vec<(String, Tensor)>,
    optimizer_step: u64,
) -> Result<(), ModelError> {
    let mut by_name: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    let names: Vec<String> = stage.params().iter().map(|(n, _)| n.to_string()).collect();
    optimizer.moments.clear();
    for name in names {
        let value = by_name
            .remove(&name)
            .ok_or_else(|| ModelError::MissingParam(name.clone()))?;
        stage.params_mut().set(&name, value)?;
        if optimizer_step > 0 {
            let m = by_name
                .remove(&m_name(&name))
                .ok_or_else(|| ModelError::MissingParam(m_name(&name)))?;
            let v = by_name
                .remove(&v_name(&name))
                .ok_or_else(|| ModelError::MissingParam(v_name(&name)))?;
            optimizer.moments.insert(name, Moments { m, v });
        }
    }
    optimizer.step = optimizer_step;
    Ok(())
}
