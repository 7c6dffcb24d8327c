//! Hugging Face `config.json`: the text backbone's dimensions (also when nested
//! under `text_config`, as in Qwen3.5's multimodal checkpoints), architecture,
//! layer types and quantization.

use crate::error::{IoError, OsContext, Result};
use crate::limits::{MAX_DIMENSION, MAX_LAYERS, MAX_VOCAB};
use serde_json::Value;
use std::fmt;
use std::path::Path;

/// Model families loraq knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Architecture {
    /// `qwen3_5`: Qwen3.5 with its text config under `text_config`.
    Qwen3_5,
    /// `qwen3_5_text`: the Qwen3.5 text backbone on its own.
    Qwen3_5Text,
    /// `qwen3`: dense Qwen3.
    Qwen3,
    /// `qwen3_next`: Qwen3-Next (fused in_proj_qkvz / in_proj_ba).
    Qwen3Next,
    /// Anything else, by its model_type.
    Other(String),
}

impl Architecture {
    fn from_model_type(model_type: &str) -> Architecture {
        match model_type {
            "qwen3_5" => Architecture::Qwen3_5,
            "qwen3_5_text" => Architecture::Qwen3_5Text,
            "qwen3" => Architecture::Qwen3,
            "qwen3_next" => Architecture::Qwen3Next,
            other => Architecture::Other(other.to_string()),
        }
    }

    /// Whether the architecture interleaves linear-attention (Gated DeltaNet) layers.
    pub fn is_hybrid(&self) -> bool {
        matches!(
            self,
            Architecture::Qwen3_5 | Architecture::Qwen3_5Text | Architecture::Qwen3Next
        )
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Architecture::Qwen3_5 => "qwen3_5",
            Architecture::Qwen3_5Text => "qwen3_5_text",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Next => "qwen3_next",
            Architecture::Other(s) => s,
        })
    }
}

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerType {
    /// Gated DeltaNet (`linear_attn`).
    LinearAttention,
    /// Softmax attention (`self_attn`).
    FullAttention,
}

impl LayerType {
    /// The name config.json uses.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerType::LinearAttention => "linear_attention",
            LayerType::FullAttention => "full_attention",
        }
    }
}

/// Quantization of a checkpoint as its `quantization_config` declares it.
#[derive(Debug, Clone, PartialEq)]
pub enum QuantizationConfig {
    /// FP8 E4M3 weights with block-wise scales (`weight_block_size`), Qwen/DeepSeek layout.
    Fp8Block {
        /// `[rows, cols]` of one scale block.
        block: [usize; 2],
        /// Modules kept in high precision.
        modules_to_not_convert: Vec<String>,
    },
    /// FP8 weights with per-tensor or per-channel scales (no `weight_block_size`).
    Fp8,
    /// NVIDIA ModelOpt NVFP4 (`quant_method: modelopt`, `quant_algo: NVFP4` or
    /// `W4A16_NVFP4`).
    ModelOptNvfp4 {
        /// Elements per scale block (16).
        group_size: usize,
        /// `W4A16_NVFP4`: activations stay unquantized (`NVFP4` quantizes them
        /// with each module's static `input_scale`).
        weight_only: bool,
    },
    /// compressed-tensors (llm-compressor), with its `format` (e.g. `nvfp4-pack-quantized`).
    CompressedTensors {
        /// The declared format.
        format: String,
    },
    /// Any other method, by name.
    Other {
        /// The declared quant_method.
        method: String,
    },
}

impl QuantizationConfig {
    fn from_json(v: &Value) -> QuantizationConfig {
        let method = v
            .get("quant_method")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_string();
        match method.as_str() {
            "fp8" => match v.get("weight_block_size").and_then(Value::as_array) {
                Some(b) if b.len() == 2 => QuantizationConfig::Fp8Block {
                    block: [
                        b[0].as_u64().unwrap_or(128) as usize,
                        b[1].as_u64().unwrap_or(128) as usize,
                    ],
                    modules_to_not_convert: string_list(v.get("modules_to_not_convert")),
                },
                _ => QuantizationConfig::Fp8,
            },
            "modelopt" => {
                let algo = v
                    .get("quant_algo")
                    .or_else(|| v.get("quantization").and_then(|q| q.get("quant_algo")))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let weight_only = algo.eq_ignore_ascii_case("W4A16_NVFP4");
                if algo.eq_ignore_ascii_case("NVFP4") || weight_only {
                    QuantizationConfig::ModelOptNvfp4 {
                        group_size: v
                            .get("group_size")
                            .or_else(|| v.get("quantization").and_then(|q| q.get("group_size")))
                            .and_then(Value::as_u64)
                            .unwrap_or(16) as usize,
                        weight_only,
                    }
                } else {
                    QuantizationConfig::Other {
                        method: format!("modelopt {algo}"),
                    }
                }
            }
            "compressed-tensors" => QuantizationConfig::CompressedTensors {
                format: v
                    .get("format")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown")
                    .to_string(),
            },
            _ => QuantizationConfig::Other { method },
        }
    }

    /// A short name for reports: `fp8-block128`, `fp8`, `nvfp4 (modelopt)`, ...
    pub fn scheme_name(&self) -> String {
        match self {
            QuantizationConfig::Fp8Block { block, .. } if block[0] == block[1] => {
                format!("fp8-block{}", block[0])
            }
            QuantizationConfig::Fp8Block { block, .. } => {
                format!("fp8-block{}x{}", block[0], block[1])
            }
            QuantizationConfig::Fp8 => "fp8".into(),
            QuantizationConfig::ModelOptNvfp4 { weight_only, .. } => if *weight_only {
                "nvfp4 (modelopt, W4A16_NVFP4: weight-only)"
            } else {
                "nvfp4 (modelopt, NVFP4: W4A4, static input_scale)"
            }
            .into(),
            QuantizationConfig::CompressedTensors { format } => {
                format!("compressed-tensors {format}")
            }
            QuantizationConfig::Other { method } => method.clone(),
        }
    }
}

fn string_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// A parsed config.json.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The whole file.
    pub raw: Value,
    /// The architecture, from the text section's model_type (or the root's).
    pub architecture: Architecture,
    /// Hidden size of the text backbone.
    pub hidden_size: usize,
    /// MLP intermediate size.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Token mixer per layer: `layer_types`, else derived from
    /// `full_attention_interval` (hybrid families), else all full attention.
    pub layer_types: Vec<LayerType>,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Declared quantization, from the root or the text section.
    pub quantization: Option<QuantizationConfig>,
}

impl ModelConfig {
    /// Reads and parses a config.json file.
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).at(path)?;
        ModelConfig::from_json_str(&text, path)
    }

    /// Parses config.json text; `origin` names the file in errors.
    pub fn from_json_str(text: &str, origin: &Path) -> Result<ModelConfig> {
        let json_err = |reason: String| IoError::Json {
            path: origin.to_path_buf(),
            reason,
        };
        let raw: Value = serde_json::from_str(text).map_err(|e| json_err(e.to_string()))?;
        if !raw.is_object() {
            return Err(json_err("config is not a JSON object".into()));
        }
        let text_section = raw
            .get("text_config")
            .filter(|t| t.is_object())
            .unwrap_or(&raw);
        let model_type = text_section
            .get("model_type")
            .or_else(|| raw.get("model_type"))
            .and_then(Value::as_str)
            .ok_or_else(|| json_err("missing string field model_type".into()))?;
        let root_type = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
        let architecture = if root_type == "qwen3_5" {
            Architecture::Qwen3_5
        } else {
            Architecture::from_model_type(model_type)
        };
        // Every size is bounded before anything is allocated from it (a layer table
        // of 2^40 entries aborted the process).
        let size = |key: &str, limit: usize| -> Result<usize> {
            let value = text_section
                .get(key)
                .and_then(Value::as_u64)
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| json_err(format!("missing non-negative integer field {key}")))?;
            if value > limit {
                return Err(json_err(format!(
                    "{key} is {value}, above loraq's limit of {limit} (docs/formats.md)"
                )));
            }
            Ok(value)
        };
        let num_hidden_layers = size("num_hidden_layers", MAX_LAYERS)?;
        let layer_types = match text_section.get("layer_types").and_then(Value::as_array) {
            Some(list) => {
                let parsed = list
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("linear_attention") => Ok(LayerType::LinearAttention),
                        Some("full_attention") => Ok(LayerType::FullAttention),
                        _ => Err(json_err(format!("unknown layer type {t} in layer_types"))),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if parsed.len() != num_hidden_layers {
                    return Err(json_err(format!(
                        "layer_types lists {} layers, num_hidden_layers is {num_hidden_layers}",
                        parsed.len()
                    )));
                }
                parsed
            }
            None if architecture.is_hybrid() => {
                let interval = text_section
                    .get("full_attention_interval")
                    .and_then(Value::as_u64)
                    .unwrap_or(4)
                    .max(1) as usize;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
            None => vec![LayerType::FullAttention; num_hidden_layers],
        };
        let quantization = raw
            .get("quantization_config")
            .or_else(|| text_section.get("quantization_config"))
            .filter(|q| q.is_object())
            .map(QuantizationConfig::from_json);
        Ok(ModelConfig {
            architecture,
            hidden_size: size("hidden_size", MAX_DIMENSION)?,
            intermediate_size: size("intermediate_size", MAX_DIMENSION)?,
            num_hidden_layers,
            layer_types,
            vocab_size: size("vocab_size", MAX_VOCAB)?,
            quantization,
            raw,
        })
    }

    /// The text backbone's section: `text_config` when nested, else the root.
    pub fn text(&self) -> &Value {
        self.raw
            .get("text_config")
            .filter(|t| t.is_object())
            .unwrap_or(&self.raw)
    }

    /// An integer field of the text section, if present.
    pub fn text_usize(&self, key: &str) -> Option<usize> {
        self.text()
            .get(key)
            .and_then(Value::as_u64)
            .and_then(|v| usize::try_from(v).ok())
    }

    /// A float field of the text section, if present.
    pub fn text_f64(&self, key: &str) -> Option<f64> {
        self.text().get(key).and_then(Value::as_f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_text_config_and_interval_give_layer_types() {
        let text = r#"{"model_type":"qwen3_5","architectures":["Qwen3_5ForConditionalGeneration"],
            "text_config":{"model_type":"qwen3_5_text","hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":8,"vocab_size":256,"full_attention_interval":4},
            "quantization_config":{"quant_method":"fp8","fmt":"e4m3","weight_block_size":[128,128]}}"#;
        let c = ModelConfig::from_json_str(text, Path::new("config.json")).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3_5);
        assert_eq!(c.hidden_size, 64);
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.layer_types[4], LayerType::LinearAttention);
        assert_eq!(c.quantization.unwrap().scheme_name(), "fp8-block128");
    }

    #[test]
    fn sizes_above_the_limits_are_refused_before_allocation() {
        // 2^40 layers aborted inspect, run and extract allocating the layer table.
        let config = |layers: u64, hidden: u64, vocab: u64| {
            format!(
                r#"{{"model_type":"qwen3_5_text","hidden_size":{hidden},"intermediate_size":128,
                "num_hidden_layers":{layers},"vocab_size":{vocab}}}"#
            )
        };
        for (text, field) in [
            (config(1 << 40, 64, 256), "num_hidden_layers"),
            (config(8, 1 << 40, 256), "hidden_size"),
            (config(8, 64, 1 << 40), "vocab_size"),
        ] {
            let err = ModelConfig::from_json_str(&text, Path::new("c/config.json"))
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("c/config.json") && err.contains(field) && err.contains("limit"),
                "{err}"
            );
        }
        assert!(ModelConfig::from_json_str(&config(8, 64, 256), Path::new("config.json")).is_ok());
    }

    #[test]
    fn missing_field_names_the_file_and_field() {
        let err =
            ModelConfig::from_json_str(r#"{"model_type":"qwen3"}"#, Path::new("x/config.json"))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("x/config.json") && err.contains("num_hidden_layers"),
            "{err}"
        );
    }
}
