//! The dimensions the forward pass needs, read from a parsed config.json.

use crate::error::{ModelError, Result};
use loraq_io::limits::MAX_DIMENSION;
use loraq_io::{Architecture, LayerType, ModelConfig};
use serde_json::Value;
use std::path::Path;

/// Which decoder family a checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Qwen3.5: Gated DeltaNet and gated attention layers, `(1 + w)` RMSNorms,
    /// partial rotary embedding.
    Qwen3_5,
    /// Dense Qwen3: attention only, plain `w` RMSNorms, full rotary embedding.
    Qwen3,
}

/// Text-backbone hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct TextConfig {
    /// Decoder family.
    pub family: Family,
    /// Hidden size.
    pub hidden: usize,
    /// MLP intermediate size.
    pub intermediate: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Token mixer per layer.
    pub layer_types: Vec<LayerType>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// Attention query heads.
    pub attention_heads: usize,
    /// Attention key/value heads.
    pub kv_heads: usize,
    /// Attention head dimension.
    pub head_dim: usize,
    /// Whether q_proj also produces a sigmoid output gate (Qwen3.5).
    pub attn_output_gate: bool,
    /// RoPE base.
    pub rope_theta: f64,
    /// Rotated dimensions per head: `int(head_dim * partial_rotary_factor)`.
    pub rotary_dim: usize,
    /// Longest prompt the model accepts.
    pub max_position_embeddings: usize,
    /// Gated DeltaNet key heads.
    pub linear_key_heads: usize,
    /// Gated DeltaNet value heads.
    pub linear_value_heads: usize,
    /// Gated DeltaNet key head dimension.
    pub linear_key_dim: usize,
    /// Gated DeltaNet value head dimension.
    pub linear_value_dim: usize,
    /// Causal conv1d kernel width.
    pub conv_kernel: usize,
    /// Whether lm_head shares the embedding matrix.
    pub tie_word_embeddings: bool,
}

impl TextConfig {
    /// Reads the hyperparameters of a supported architecture; `path` names config.json.
    pub fn from_model_config(config: &ModelConfig, path: &Path) -> Result<TextConfig> {
        let family = match config.architecture {
            Architecture::Qwen3_5 | Architecture::Qwen3_5Text => Family::Qwen3_5,
            Architecture::Qwen3 => Family::Qwen3,
            ref other => {
                return Err(ModelError::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    architecture: other.to_string(),
                });
            }
        };
        let bad = |reason: String| ModelError::Config {
            path: path.to_path_buf(),
            reason,
        };
        // Head counts and widths are bounded before any table is sized from them.
        let bounded = |key: &str, value: usize| -> Result<usize> {
            if value > MAX_DIMENSION {
                return Err(bad(format!(
                    "{key} is {value}, above loraq's limit of {MAX_DIMENSION} (docs/formats.md)"
                )));
            }
            Ok(value)
        };
        let optional = |key: &str| -> Result<Option<usize>> {
            config.text_usize(key).map(|v| bounded(key, v)).transpose()
        };
        let need = |key: &str| -> Result<usize> {
            optional(key)?.ok_or_else(|| bad(format!("missing non-negative integer field {key}")))
        };
        let text = config.text();
        let rope = text
            .get("rope_parameters")
            .or_else(|| text.get("rope_scaling"));
        let rope_field = |key: &str| -> Option<f64> {
            rope.and_then(|r| r.get(key))
                .and_then(Value::as_f64)
                .or_else(|| config.text_f64(key))
        };
        if let Some(kind) = rope
            .and_then(|r| r.get("rope_type").or_else(|| r.get("type")))
            .and_then(Value::as_str)
            && kind != "default"
        {
            return Err(bad(format!(
                "rope_type {kind:?} is not supported (only \"default\")"
            )));
        }
        let attention_heads = need("num_attention_heads")?;
        let hidden = config.hidden_size;
        let head_dim = optional("head_dim")?.unwrap_or(hidden / attention_heads.max(1));
        let partial = match family {
            Family::Qwen3_5 => rope_field("partial_rotary_factor").unwrap_or(1.0),
            Family::Qwen3 => 1.0,
        };
        // transformers: int(head_dim * partial_rotary_factor).
        let rotary_dim = (head_dim as f64 * partial) as usize;
        if !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(bad(format!(
                "rotary dimension {rotary_dim} (head_dim {head_dim} x partial_rotary_factor {partial}) must be even and at most head_dim"
            )));
        }
        let kv_heads = optional("num_key_value_heads")?.unwrap_or(attention_heads);
        if kv_heads == 0 || attention_heads % kv_heads != 0 {
            return Err(bad(format!(
                "num_attention_heads {attention_heads} is not a multiple of num_key_value_heads {kv_heads}"
            )));
        }
        let has_linear = config.layer_types.contains(&LayerType::LinearAttention);
        if family == Family::Qwen3 && has_linear {
            return Err(bad("qwen3 has no linear-attention layers".into()));
        }
        let linear = |key: &str| -> Result<usize> { if has_linear { need(key) } else { Ok(0) } };
        let linear_key_heads = linear("linear_num_key_heads")?;
        let linear_value_heads = linear("linear_num_value_heads")?;
        if has_linear && (linear_key_heads == 0 || linear_value_heads % linear_key_heads != 0) {
            return Err(bad(format!(
                "linear_num_value_heads {linear_value_heads} is not a multiple of linear_num_key_heads {linear_key_heads}"
            )));
        }
        let tie = text
            .get("tie_word_embeddings")
            .or_else(|| config.raw.get("tie_word_embeddings"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Ok(TextConfig {
            family,
            hidden,
            intermediate: config.intermediate_size,
            vocab: config.vocab_size,
            layer_types: config.layer_types.clone(),
            rms_norm_eps: config.text_f64("rms_norm_eps").unwrap_or(1e-6) as f32,
            attention_heads,
            kv_heads,
            head_dim,
            attn_output_gate: match family {
                Family::Qwen3_5 => text
                    .get("attn_output_gate")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
                Family::Qwen3 => false,
            },
            rope_theta: rope_field("rope_theta").unwrap_or(10_000.0),
            rotary_dim,
            max_position_embeddings: config
                .text_usize("max_position_embeddings")
                .unwrap_or(usize::MAX),
            linear_key_heads,
            linear_value_heads,
            linear_key_dim: linear("linear_key_head_dim")?,
            linear_value_dim: linear("linear_value_head_dim")?,
            conv_kernel: if has_linear {
                need("linear_conv_kernel_dim")?
            } else {
                0
            },
            tie_word_embeddings: tie,
        })
    }

    /// The RMSNorm weight offset: Qwen3.5 stores `w` and multiplies by `1 + w`.
    pub fn norm_offset(&self) -> f32 {
        match self.family {
            Family::Qwen3_5 => 1.0,
            Family::Qwen3 => 0.0,
        }
    }
}
