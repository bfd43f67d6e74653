//! Hugging Face `GPT2LMHeadModel` interop: one consolidated `model.safetensors` plus `config.json`.
//!
//! GPT-2's `Conv1D` stores linear weights as `(in, out)`; seqpipe stores `(out, in)`, so the four
//! block matrices are transposed on the way out and back in. The LM head is an `nn.Linear` in both.
//!
//! [`export`] never writes through a link: each file is written under a fresh name in the output
//! directory and renamed over the old one, so a symlink planted there is replaced, not followed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::json;
use thiserror::Error;

use crate::model::params::param_specs;
use crate::model::{ModelConfig, Norm, Position};

/// HF interop failures.
#[derive(Debug, Error)]
pub enum HfError {
    /// The model cannot be expressed as GPT-2.
    #[error(
        "the hf-gpt2 format needs model.position = \"learned\" and model.norm = \"layernorm\" (this model has {position:?} positions and {norm:?})"
    )]
    NotGpt2 { position: Position, norm: Norm },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A tensor file could not be used.
    #[error("{path}: {reason}")]
    Tensors { path: PathBuf, reason: String },
    /// The directory's config.json does not describe this model.
    #[error(
        "{path}: {field} is {found} but the model config has {expected}; use a matching --config/--set"
    )]
    Mismatch {
        path: PathBuf,
        field: &'static str,
        found: String,
        expected: String,
    },
}

/// Whether our parameter `name` is a `Conv1D` weight in GPT-2 (stored transposed there).
fn is_conv1d(name: &str) -> bool {
    name.starts_with("h.")
        && name.ends_with(".weight")
        && [
            ".attn.c_attn.",
            ".attn.c_proj.",
            ".mlp.c_fc.",
            ".mlp.c_proj.",
        ]
        .iter()
        .any(|m| name.contains(m))
}

/// Our name → the Hugging Face GPT-2 name.
pub fn hf_name(name: &str) -> String {
    if name == "lm_head.weight" {
        name.to_string()
    } else {
        format!("transformer.{name}")
    }
}

fn check_gpt2(cfg: &ModelConfig) -> Result<(), HfError> {
    if cfg.position != Position::Learned || cfg.norm != Norm::LayerNorm {
        return Err(HfError::NotGpt2 {
            position: cfg.position,
            norm: cfg.norm,
        });
    }
    Ok(())
}

/// The `config.json` of a model.
pub fn hf_config(cfg: &ModelConfig) -> serde_json::Value {
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.layers,
        "n_head": cfg.heads,
        "n_inner": cfg.ffn(),
        "activation_function": "gelu_new",
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": false,
        "torch_dtype": "float32",
    })
}

/// Writes `dir/model.safetensors` and `dir/config.json` from all parameters (our names).
pub fn export(
    cfg: &ModelConfig,
    params: &HashMap<String, Tensor>,
    dir: &Path,
) -> Result<(), HfError> {
    check_gpt2(cfg)?;
    let io = |path: PathBuf| {
        move |source| HfError::Io {
            path: path.clone(),
            source,
        }
    };
    std::fs::create_dir_all(dir).map_err(io(dir.to_path_buf()))?;
    let model_path = dir.join("model.safetensors");
    let bad = |reason: String| HfError::Tensors {
        path: model_path.clone(),
        reason,
    };
    let mut out = HashMap::new();
    for spec in param_specs(cfg) {
        let t = params.get(&spec.name).ok_or_else(|| {
            bad(format!(
                "parameter {} is missing from the checkpoint",
                spec.name
            ))
        })?;
        let t = if is_conv1d(&spec.name) {
            t.t()
                .and_then(|t| t.contiguous())
                .map_err(|e| bad(e.to_string()))?
        } else {
            t.clone()
        };
        out.insert(hf_name(&spec.name), t);
    }
    let bytes = safetensors::serialize(&out, None).map_err(|e| bad(e.to_string()))?;
    write_replacing(dir, "model.safetensors", &bytes).map_err(io(model_path.clone()))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&hf_config(cfg)).expect("json");
    write_replacing(dir, "config.json", text.as_bytes()).map_err(io(config_path))
}

/// Writes `dir/name` without following a link there: the bytes go to a fresh file of a random
/// name in `dir` (created with `O_CREAT | O_EXCL | O_NOFOLLOW`, so nothing that already exists,
/// link or file, is opened), which then replaces `dir/name` by `rename` — a symlink at `dir/name`
/// is replaced itself, the file it pointed to is left as it was.
fn write_replacing(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = dir.join(format!(".{name}.{:016x}.tmp", rand::random::<u64>()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(&tmp)
        .and_then(|mut file| {
            file.write_all(bytes)?;
            file.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, dir.join(name)));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Reads the named parameters (our names) from a directory written by [`export`] or by Hugging Face,
/// after checking that its `config.json` matches `cfg`.
pub fn import(
    cfg: &ModelConfig,
    dir: &Path,
    names: &[String],
) -> Result<Vec<(String, Tensor)>, HfError> {
    check_gpt2(cfg)?;
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|source| HfError::Io {
        path: config_path.clone(),
        source,
    })?;
    let found: serde_json::Value = serde_json::from_str(&text).map_err(|e| HfError::Tensors {
        path: config_path.clone(),
        reason: e.to_string(),
    })?;
    let expected = hf_config(cfg);
    for field in [
        "vocab_size",
        "n_positions",
        "n_embd",
        "n_layer",
        "n_head",
        "n_inner",
    ] {
        if found.get(field) != expected.get(field) {
            return Err(HfError::Mismatch {
                path: config_path,
                field,
                found: found.get(field).map_or("missing".into(), |v| v.to_string()),
                expected: expected[field].to_string(),
            });
        }
    }
    let model_path = dir.join("model.safetensors");
    let bad = |reason: String| HfError::Tensors {
        path: model_path.clone(),
        reason,
    };
    // SAFETY of the mapping: the file is only read; candle copies each tensor out of the map.
    let file = unsafe { candle_core::safetensors::MmapedSafetensors::new(&model_path) }
        .map_err(|e| bad(e.to_string()))?;
    names
        .iter()
        .map(|name| {
            let t = file
                .load(&hf_name(name), &Device::Cpu)
                .map_err(|e| bad(format!("{}: {e}", hf_name(name))))?;
            let t = if is_conv1d(name) {
                t.t()
                    .and_then(|t| t.contiguous())
                    .map_err(|e| bad(e.to_string()))?
            } else {
                t
            };
            Ok((name.clone(), t))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv1d_names() {
        assert!(is_conv1d("h.3.attn.c_attn.weight"));
        assert!(is_conv1d("h.0.mlp.c_proj.weight"));
        assert!(!is_conv1d("h.0.mlp.c_proj.bias"));
        assert!(!is_conv1d("lm_head.weight"));
        assert!(!is_conv1d("wte.weight"));
        assert_eq!(hf_name("h.1.ln_1.weight"), "transformer.h.1.ln_1.weight");
        assert_eq!(hf_name("lm_head.weight"), "lm_head.weight");
    }
}
