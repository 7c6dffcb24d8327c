//! Quantized checkpoint layouts: reading any of them back to exact `f32` weights
//! ([`QuantizedBase`]) and writing them ([`plan_quantization`] /
//! [`write_quantized`]).
//!
//! Read (detected per weight from the tensor names, checked against
//! `quantization_config`):
//! * fp8-block128 (Qwen / DeepSeek): `X.weight` F8_E4M3 `[out, in]` +
//!   `X.weight_scale_inv` `[ceil(out/128), ceil(in/128)]` in F32, BF16 or F16, a
//!   dequantization multiplier despite its name;
//! * fp8 per tensor / per channel: `X.weight` F8_E4M3 + `X.weight_scale` `[]`, `[1]`,
//!   `[out]` or `[out, 1]` (vLLM `fp8`, compressed-tensors float-quantized);
//! * NVFP4 ModelOpt: `X.weight` U8 `[out, in/2]` + `X.weight_scale` F8_E4M3
//!   `[out, in/16]` + `X.weight_scale_2` F32 (multiplier);
//! * NVFP4 compressed-tensors: `X.weight_packed` U8 + `X.weight_scale` F8_E4M3 +
//!   `X.weight_global_scale` F32 (divisor);
//! * plain BF16 / F16 / F32 weights (bf16-emulated checkpoints are plain).
//!
//! Written: fp8-block128, fp8-tensor (vLLM `fp8` per-tensor), fp8-channel-ct
//! (compressed-tensors per-channel FP8), NVFP4 ModelOpt, NVFP4 compressed-tensors
//! and bf16-emulated, one tensor in memory at a time. NVFP4 is written weight-only
//! (W4A16) unless a calibration file gives every quantized module its input
//! absolute maximum, which turns into a static activation scale (W4A4).

use crate::error::{QuantError, Result};
use crate::format::{
    FP8_BLOCK, Fp8Granularity, NVFP4_BLOCK, NVFP4_GLOBAL_DENOMINATOR, Nvfp4GlobalScale,
    WeightFormat, blocks, fp8_scale_shape,
};
use crate::ggml::{GgmlType, GgmlWeight};
use crate::scheme::{Bf16WeightView, Scheme, WeightView};
use crate::weight::{
    Bf16Weight, Fp8Weight, Nvfp4Weight, QuantizedWeight, dequantize_fp8_into, dequantize_nvfp4_into,
};
use loraq_io::{
    Checkpoint, CheckpointWriter, DType, QuantizationConfig, TensorInfo, TensorSpec, WriteCaching,
};
use regex::Regex;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// How one linear weight is stored in a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub enum StoredWeight {
    /// A plain float matrix (BF16, F16, F32, F64).
    Float {
        /// The stored dtype.
        dtype: DType,
    },
    /// FP8 E4M3 codes with a scale per tensor, output row or 128x128 tile.
    Fp8 {
        /// Which scale applies where.
        granularity: Fp8Granularity,
        /// The scale tensor (`weight_scale_inv` for blocks, else `weight_scale`).
        scale: String,
    },
    /// NVFP4 in the ModelOpt layout.
    Nvfp4ModelOpt {
        /// The E4M3 block-scale tensor.
        block_scale: String,
        /// The F32 global scale (multiplier).
        global_scale: String,
    },
    /// NVFP4 in the compressed-tensors layout.
    Nvfp4CompressedTensors {
        /// The packed U8 codes.
        packed: String,
        /// The E4M3 block-scale tensor.
        block_scale: String,
        /// The F32 global scale (divisor).
        global_scale: String,
    },
    /// A ggml block type of a GGUF base (llama.cpp): the tensor is U8 `[out_features,
    /// row bytes]`, each row a run of blocks ([`crate::ggml::row_bytes`]).
    Ggml {
        /// The stored type.
        ggml_type: GgmlType,
        /// `None` when the columns are in the checkpoint's order. Set for a weight
        /// kept in GGUF's column order (a qwen35 `out_proj` whose value heads cut
        /// through its blocks, loraq-gguf's `BlockWeight::input_gather`): stored
        /// column `j` is the checkpoint's column `input_gather[j]`.
        /// [`QuantizedBase::read_weight_f32`] puts the columns back;
        /// [`QuantizedBase::quantized_weight`] gives the blocks as stored, to be run
        /// on the input gathered by [`LinearWeight::input_gather`].
        input_gather: Option<Vec<usize>>,
    },
}

impl StoredWeight {
    /// The stored format, `None` for a float matrix other than bf16.
    pub fn format(&self) -> Option<WeightFormat> {
        match self {
            Self::Float { dtype: DType::BF16 } => Some(WeightFormat::Bf16),
            Self::Float { .. } => None,
            Self::Fp8 { granularity, .. } => Some(WeightFormat::Fp8(*granularity)),
            Self::Nvfp4ModelOpt { .. } | Self::Nvfp4CompressedTensors { .. } => {
                Some(WeightFormat::Nvfp4)
            }
            Self::Ggml { ggml_type, .. } => Some(WeightFormat::Ggml(*ggml_type)),
        }
    }

    /// Short name of the storage format.
    pub fn format_name(&self) -> String {
        match self {
            Self::Float { dtype } => dtype.as_str().to_lowercase(),
            Self::Fp8 { granularity, .. } => WeightFormat::Fp8(*granularity).name().into(),
            Self::Nvfp4ModelOpt { .. } => "nvfp4 (modelopt)".into(),
            Self::Nvfp4CompressedTensors { .. } => "nvfp4 (compressed-tensors)".into(),
            Self::Ggml { ggml_type, .. } => format!("gguf {ggml_type}"),
        }
    }
}

/// One linear weight of a [`QuantizedBase`].
#[derive(Clone, Debug, PartialEq)]
pub struct LinearWeight {
    /// Logical name, `<module path>.weight`, whatever the layout calls the codes.
    pub name: String,
    /// Output features.
    pub out_features: usize,
    /// Input features.
    pub in_features: usize,
    /// How it is stored.
    pub stored: StoredWeight,
}

impl LinearWeight {
    /// The gather of the input a product with the stored weight
    /// ([`QuantizedBase::quantized_weight`]) takes: `None` when the stored columns are
    /// the checkpoint's, else `g` with the checkpoint's `W x` equal to the stored
    /// matrix times `[x[g[0]], x[g[1]], ...]` (a permutation of `0..in_features`).
    pub fn input_gather(&self) -> Option<&[usize]> {
        match &self.stored {
            StoredWeight::Ggml {
                input_gather: Some(gather),
                ..
            } => Some(gather),
            _ => None,
        }
    }
}

/// A GGUF model (llama.cpp; the first file of a split model) opened as the
/// checkpoint it was converted from (loraq-gguf's `open_with_blocks`): the decoder
/// layers' linear weights of a block type (Q8_0, Q4_K, ...) kept in it, every other
/// tensor of a block type decoded exactly to f32 by [`crate::ggml`].
pub fn open_gguf_checkpoint(path: &Path) -> Result<loraq_gguf::base::GgufCheckpoint> {
    let decode = |id: u32, data: &[u8], in_features: usize, out: &mut [f32]| {
        let Some(ggml_type) = GgmlType::from_id(id).filter(|&t| crate::ggml::is_decodable(t))
        else {
            return false;
        };
        let rows = out.len().checked_div(in_features).unwrap_or(0);
        let fits = rows * in_features == out.len()
            && crate::ggml::matrix_bytes(ggml_type, "", rows, in_features).ok() == Some(data.len());
        if fits {
            crate::ggml::decode::decode_rows(ggml_type, data, in_features, out);
        }
        fits
    };
    Ok(loraq_gguf::base::open_with_blocks(path, &decode)?)
}

/// A checkpoint whose 2-D weights can each be decoded exactly to `f32`, whatever
/// the layout: what `extract`, `verify` and `run` read a base through.
pub struct QuantizedBase {
    checkpoint: Checkpoint,
    weights: BTreeMap<String, LinearWeight>,
}

/// The f16 scales of every block of a ggml weight, by block index.
fn ggml_f16_scales(ggml_type: GgmlType, data: &[u8]) -> impl Iterator<Item = f32> + '_ {
    let bytes = ggml_type.block().bytes;
    data.chunks_exact(bytes).flat_map(move |block| {
        crate::ggml::f16_scale_offsets(ggml_type)
            .iter()
            .map(|&o| crate::ggml::fp16_to_f32(u16::from_le_bytes([block[o], block[o + 1]])))
    })
}

/// Whether `gather` holds each of `0..n` exactly once.
fn is_permutation(gather: &[usize], n: usize) -> bool {
    let mut seen = vec![false; n];
    gather.len() == n
        && gather
            .iter()
            .all(|&i| i < n && !std::mem::replace(&mut seen[i], true))
}

fn tensor_error(info: &TensorInfo, expected: &[&str]) -> QuantError {
    QuantError::TensorDtype {
        tensor: info.name.clone(),
        actual: info.dtype.as_str().to_string(),
        expected: expected.join(" or "),
    }
}

fn require_dtype(info: &TensorInfo, allowed: &[DType]) -> Result<()> {
    if allowed.contains(&info.dtype) {
        Ok(())
    } else {
        let names: Vec<&str> = allowed.iter().map(|d| d.as_str()).collect();
        Err(tensor_error(info, &names))
    }
}

fn require_shape(info: &TensorInfo, expected: &[usize]) -> Result<()> {
    if info.shape == expected {
        Ok(())
    } else {
        Err(QuantError::TensorShape {
            tensor: info.name.clone(),
            actual: info.shape.clone(),
            expected: expected.to_vec(),
        })
    }
}

/// A one-element F32 tensor (shape `[]` or `[1]`), e.g. a global scale.
fn require_scalar(info: &TensorInfo) -> Result<()> {
    require_dtype(info, &[DType::F32])?;
    if info.shape.iter().product::<usize>() != 1 || info.shape.len() > 1 {
        return Err(QuantError::TensorShape {
            tensor: info.name.clone(),
            actual: info.shape.clone(),
            expected: vec![1],
        });
    }
    Ok(())
}

const SCALE_DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

impl QuantizedBase {
    /// Opens a checkpoint directory (or file) and detects how every weight is stored.
    /// A `.gguf` file (llama.cpp; the first file of a split model) is read in the
    /// checkpoint's terms through loraq-gguf, its block types (Q8_0, Q4_K, ...)
    /// decoded exactly by [`crate::ggml`] (docs/gguf.md, GGUF bases).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if loraq_gguf::base::is_gguf(path) {
            let gguf = open_gguf_checkpoint(path)?;
            return Self::with_blocks(gguf.checkpoint, &gguf.block_weights);
        }
        Self::new(Checkpoint::open(path)?)
    }

    /// [`QuantizedBase::new`] for a GGUF base: the tensors `block_weights` names are
    /// linear weights in a ggml block type ([`StoredWeight::Ggml`]).
    fn with_blocks(
        checkpoint: Checkpoint,
        block_weights: &BTreeMap<String, loraq_gguf::base::BlockWeight>,
    ) -> Result<Self> {
        let mut base = Self::new_except(checkpoint, |name| block_weights.contains_key(name))?;
        for (name, w) in block_weights {
            if !crate::ggml::is_decodable(w.ggml_type) {
                return Err(QuantError::UnsupportedConfig {
                    path: base.checkpoint.root().to_path_buf(),
                    reason: format!(
                        "{name} is stored as GGUF {}, a type loraq does not decode",
                        w.ggml_type
                    ),
                });
            }
            let info = base.checkpoint.info(name)?;
            let row_bytes = crate::ggml::row_bytes(w.ggml_type, name, w.in_features)?;
            require_dtype(info, &[DType::U8])?;
            require_shape(info, &[w.out_features, row_bytes])?;
            if let Some(gather) = &w.input_gather
                && !is_permutation(gather, w.in_features)
            {
                return Err(QuantError::UnsupportedConfig {
                    path: base.checkpoint.root().to_path_buf(),
                    reason: format!(
                        "{name}: its input gather ({} entries) is not a permutation of its {} columns",
                        gather.len(),
                        w.in_features
                    ),
                });
            }
            base.weights.insert(
                name.clone(),
                LinearWeight {
                    name: name.clone(),
                    out_features: w.out_features,
                    in_features: w.in_features,
                    stored: StoredWeight::Ggml {
                        ggml_type: w.ggml_type,
                        input_gather: w.input_gather.clone(),
                    },
                },
            );
        }
        Ok(base)
    }

    /// Detects how every 2-D weight of `checkpoint` is stored and checks the scale
    /// tensors' dtypes and shapes.
    pub fn new(checkpoint: Checkpoint) -> Result<Self> {
        Self::new_except(checkpoint, |_| false)
    }

    /// [`QuantizedBase::new`], leaving out the tensors `skip` names.
    fn new_except(checkpoint: Checkpoint, skip: impl Fn(&str) -> bool) -> Result<Self> {
        let root = checkpoint.root().to_path_buf();
        if let Some(QuantizationConfig::Fp8Block { block, .. }) =
            checkpoint.config().and_then(|c| c.quantization.as_ref())
            && *block != [FP8_BLOCK, FP8_BLOCK]
        {
            return Err(QuantError::UnsupportedConfig {
                path: root,
                reason: format!("weight_block_size {block:?}: only [128, 128] is supported"),
            });
        }
        let mut weights = BTreeMap::new();
        for info in checkpoint.tensors().filter(|info| !skip(&info.name)) {
            if let Some(weight) = detect(&checkpoint, info)? {
                weights.insert(weight.name.clone(), weight);
            }
        }
        Ok(Self {
            checkpoint,
            weights,
        })
    }

    /// The underlying checkpoint (for the tensors that are not linear weights).
    pub fn checkpoint(&self) -> &Checkpoint {
        &self.checkpoint
    }

    /// Every 2-D weight, by logical name (`<module path>.weight`).
    pub fn weights(&self) -> impl Iterator<Item = &LinearWeight> {
        self.weights.values()
    }

    /// The weight called `name` (`<module path>.weight`).
    pub fn weight(&self, name: &str) -> Result<&LinearWeight> {
        self.weights
            .get(name)
            .ok_or_else(|| QuantError::MissingTensor {
                path: self.checkpoint.root().to_path_buf(),
                tensor: name.to_string(),
                layout: "any",
            })
    }

    /// The weight decoded exactly to `f32`, `[out_features * in_features]` row-major.
    pub fn read_weight_f32(&self, name: &str) -> Result<Vec<f32>> {
        let weight = self.weight(name)?;
        let len = weight
            .out_features
            .checked_mul(weight.in_features)
            .ok_or_else(|| QuantError::ShapeMismatch {
                tensor: name.to_string(),
                out_features: weight.out_features,
                in_features: weight.in_features,
                len: usize::MAX,
            })?;
        let mut out = vec![0.0f32; len];
        self.read_weight_f32_into(name, &mut out)?;
        Ok(out)
    }

    /// Decodes the weight into `out` (`out_features * in_features` values).
    pub fn read_weight_f32_into(&self, name: &str, out: &mut [f32]) -> Result<()> {
        let weight = self.weight(name)?;
        if out.len() != weight.out_features * weight.in_features {
            return Err(QuantError::ShapeMismatch {
                tensor: name.to_string(),
                out_features: weight.out_features,
                in_features: weight.in_features,
                len: out.len(),
            });
        }
        let ckpt = &self.checkpoint;
        match &weight.stored {
            StoredWeight::Float { .. } => ckpt.read_f32_into(name, out)?,
            StoredWeight::Fp8 { granularity, scale } => {
                let scales = ckpt.read_f32(scale)?;
                dequantize_fp8_into(
                    ckpt.bytes(name)?,
                    &scales,
                    *granularity,
                    weight.in_features,
                    out,
                );
            }
            StoredWeight::Nvfp4ModelOpt {
                block_scale,
                global_scale,
            } => {
                let global = Nvfp4GlobalScale::Multiplier(ckpt.read_f32(global_scale)?[0]);
                dequantize_nvfp4_into(ckpt.bytes(name)?, ckpt.bytes(block_scale)?, global, out);
            }
            StoredWeight::Nvfp4CompressedTensors {
                packed,
                block_scale,
                global_scale,
            } => {
                let global = Nvfp4GlobalScale::Divisor(ckpt.read_f32(global_scale)?[0]);
                dequantize_nvfp4_into(ckpt.bytes(packed)?, ckpt.bytes(block_scale)?, global, out);
            }
            StoredWeight::Ggml {
                ggml_type,
                input_gather,
            } => {
                let data = ckpt.bytes(name)?;
                match input_gather {
                    None => {
                        crate::ggml::decode::decode_rows(*ggml_type, data, weight.in_features, out)
                    }
                    // Stored column j is the checkpoint's column gather[j]: each row
                    // decoded, then scattered back (the values the decode gives, so
                    // bit-identical to decoding the whole tensor and gathering).
                    Some(gather) => {
                        let cols = weight.in_features;
                        let row_bytes = data.len().checked_div(weight.out_features).unwrap_or(0);
                        let mut row = vec![0f32; cols];
                        for (stored, out_row) in data
                            .chunks_exact(row_bytes.max(1))
                            .zip(out.chunks_exact_mut(cols.max(1)))
                        {
                            crate::ggml::decode::decode_rows(*ggml_type, stored, cols, &mut row);
                            for (&value, &c) in row.iter().zip(gather) {
                                out_row[c] = value;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The weight of module `module` (its path, without `.weight`) in its stored
    /// format, codes and scales copied as the checkpoint holds them (compressed-tensors
    /// NVFP4 keeps its divisor global scale), read once. A NaN or infinite value (a
    /// bf16 value, an E4M3 code or scale, a global scale) is refused naming the file,
    /// the tensor and the element. A plain f16 / f32 / f64 matrix has no stored-format
    /// weight: [`QuantError::UnsupportedFormat`]. A GGUF weight kept in GGUF's column
    /// order comes in that order: its product takes the input gathered by
    /// [`LinearWeight::input_gather`] (and a LoRA A's columns gathered the same way).
    pub fn quantized_weight(&self, module: &str) -> Result<QuantizedWeight> {
        let name = format!("{module}.weight");
        let weight = self.weight(&name)?;
        let ckpt = &self.checkpoint;
        let (out_features, in_features) = (weight.out_features, weight.in_features);
        let finite = |tensor: &str, values: &mut dyn Iterator<Item = f32>| -> Result<()> {
            match values.enumerate().find(|(_, v)| !v.is_finite()) {
                None => Ok(()),
                Some((index, value)) => Err(ckpt.non_finite_error(tensor, index, value).into()),
            }
        };
        fn e4m3(codes: &[u8]) -> impl Iterator<Item = f32> + '_ {
            codes.iter().map(|&c| crate::element::e4m3_decode(c))
        }
        // NVFP4: the global scale keeps the direction its layout stores it in.
        let nvfp4 = |packed: &str,
                     block_scale: &str,
                     global_scale: &str,
                     direction: fn(f32) -> Nvfp4GlobalScale|
         -> Result<QuantizedWeight> {
            let block_scales = ckpt.bytes(block_scale)?.to_vec();
            finite(block_scale, &mut e4m3(&block_scales))?;
            let global = ckpt.read_f32(global_scale)?[0];
            finite(global_scale, &mut std::iter::once(global))?;
            Ok(QuantizedWeight::Nvfp4(Nvfp4Weight {
                out_features,
                in_features,
                packed: ckpt.bytes(packed)?.to_vec(),
                block_scales,
                global_scale: direction(global),
            }))
        };
        Ok(match &weight.stored {
            StoredWeight::Float { dtype: DType::BF16 } => {
                let data: Vec<half::bf16> = ckpt
                    .bytes(&name)?
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])))
                    .collect();
                finite(&name, &mut data.iter().map(|v| v.to_f32()))?;
                QuantizedWeight::Bf16(Bf16Weight {
                    out_features,
                    in_features,
                    data,
                })
            }
            StoredWeight::Float { .. } => {
                return Err(QuantError::UnsupportedFormat {
                    tensor: name,
                    format: weight.stored.format_name(),
                });
            }
            StoredWeight::Fp8 { granularity, scale } => {
                let codes = ckpt.bytes(&name)?.to_vec();
                finite(&name, &mut e4m3(&codes))?;
                let scales = ckpt.read_f32(scale)?;
                finite(scale, &mut scales.iter().copied())?;
                QuantizedWeight::Fp8(Fp8Weight {
                    out_features,
                    in_features,
                    granularity: *granularity,
                    codes,
                    scales,
                })
            }
            StoredWeight::Nvfp4ModelOpt {
                block_scale,
                global_scale,
            } => nvfp4(
                &name,
                block_scale,
                global_scale,
                Nvfp4GlobalScale::Multiplier,
            )?,
            StoredWeight::Nvfp4CompressedTensors {
                packed,
                block_scale,
                global_scale,
            } => nvfp4(packed, block_scale, global_scale, Nvfp4GlobalScale::Divisor)?,
            // In the stored column order ([`LinearWeight::input_gather`]).
            StoredWeight::Ggml { ggml_type, .. } => {
                let data = ckpt.bytes(&name)?.to_vec();
                // A NaN or infinite f16 scale makes its whole block so (the error
                // gives the scale's index in block order).
                finite(&name, &mut ggml_f16_scales(*ggml_type, &data))?;
                QuantizedWeight::Ggml(GgmlWeight::new(
                    &name,
                    *ggml_type,
                    out_features,
                    in_features,
                    data,
                )?)
            }
        })
    }
}

/// Classifies one tensor: `Some` for the codes / matrix of a linear weight, `None`
/// for scales and everything else.
fn detect(ckpt: &Checkpoint, info: &TensorInfo) -> Result<Option<LinearWeight>> {
    let name = info.name.as_str();
    if let Some(module) = name.strip_suffix(".weight_packed") {
        // compressed-tensors NVFP4.
        require_dtype(info, &[DType::U8])?;
        let (out_features, half_cols) = matrix(info)?;
        let in_features = half_cols * 2;
        let block_scale = format!("{module}.weight_scale");
        let global_scale = format!("{module}.weight_global_scale");
        let scale_info = needed(ckpt, &block_scale, "nvfp4 compressed-tensors")?;
        require_dtype(scale_info, &[DType::F8E4M3])?;
        require_shape(scale_info, &[out_features, in_features / NVFP4_BLOCK])?;
        require_block_multiple(info, in_features)?;
        require_scalar(needed(ckpt, &global_scale, "nvfp4 compressed-tensors")?)?;
        return Ok(Some(LinearWeight {
            name: format!("{module}.weight"),
            out_features,
            in_features,
            stored: StoredWeight::Nvfp4CompressedTensors {
                packed: name.to_string(),
                block_scale,
                global_scale,
            },
        }));
    }
    let Some(module) = name.strip_suffix(".weight") else {
        return Ok(None);
    };
    if info.shape.len() != 2 {
        return Ok(None);
    }
    let (out_features, stored_cols) = matrix(info)?;
    let stored = match info.dtype {
        DType::F8E4M3 => {
            let scale_inv = format!("{module}.weight_scale_inv");
            let scale = format!("{module}.weight_scale");
            if let Some(scale_info) = ckpt.get(&scale_inv) {
                require_dtype(scale_info, &SCALE_DTYPES)?;
                require_shape(
                    scale_info,
                    &fp8_scale_shape(Fp8Granularity::Block128, out_features, stored_cols),
                )?;
                StoredWeight::Fp8 {
                    granularity: Fp8Granularity::Block128,
                    scale: scale_inv,
                }
            } else {
                let scale_info = needed(ckpt, &scale, "fp8")?;
                require_dtype(scale_info, &SCALE_DTYPES)?;
                let granularity = match scale_info.shape.as_slice() {
                    [] | [1] | [1, 1] => Fp8Granularity::Tensor,
                    [n] | [n, 1] if *n == out_features => Fp8Granularity::Channel,
                    _ => {
                        return Err(QuantError::TensorShape {
                            tensor: scale.clone(),
                            actual: scale_info.shape.clone(),
                            expected: vec![out_features, 1],
                        });
                    }
                };
                StoredWeight::Fp8 { granularity, scale }
            }
        }
        DType::U8 => {
            // ModelOpt NVFP4: two codes per byte.
            let in_features = stored_cols * 2;
            let block_scale = format!("{module}.weight_scale");
            let global_scale = format!("{module}.weight_scale_2");
            let scale_info = needed(ckpt, &block_scale, "nvfp4 modelopt")?;
            require_dtype(scale_info, &[DType::F8E4M3])?;
            require_block_multiple(info, in_features)?;
            require_shape(scale_info, &[out_features, in_features / NVFP4_BLOCK])?;
            require_scalar(needed(ckpt, &global_scale, "nvfp4 modelopt")?)?;
            return Ok(Some(LinearWeight {
                name: name.to_string(),
                out_features,
                in_features,
                stored: StoredWeight::Nvfp4ModelOpt {
                    block_scale,
                    global_scale,
                },
            }));
        }
        dtype if dtype.is_float() => StoredWeight::Float { dtype },
        _ => return Err(tensor_error(info, &["BF16", "F16", "F32", "F8_E4M3", "U8"])),
    };
    Ok(Some(LinearWeight {
        name: name.to_string(),
        out_features,
        in_features: stored_cols,
        stored,
    }))
}

fn matrix(info: &TensorInfo) -> Result<(usize, usize)> {
    info.matrix_shape().ok_or_else(|| QuantError::TensorShape {
        tensor: info.name.clone(),
        actual: info.shape.clone(),
        expected: vec![0, 0],
    })
}

fn require_block_multiple(info: &TensorInfo, in_features: usize) -> Result<()> {
    if !in_features.is_multiple_of(NVFP4_BLOCK) {
        return Err(QuantError::InputDimNotDivisible {
            tensor: info.name.clone(),
            scheme: "nvfp4",
            multiple: NVFP4_BLOCK,
            in_features,
        });
    }
    Ok(())
}

fn needed<'a>(ckpt: &'a Checkpoint, name: &str, layout: &'static str) -> Result<&'a TensorInfo> {
    ckpt.get(name).ok_or_else(|| QuantError::MissingTensor {
        path: ckpt.root().to_path_buf(),
        tensor: name.to_string(),
        layout,
    })
}

// ------------------------------------------------------------------------------
// Writing

/// A checkpoint layout `loraq quantize` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Qwen / DeepSeek block FP8: `weight` F8_E4M3 + `weight_scale_inv` F32.
    Fp8Block128,
    /// vLLM `fp8` per-tensor: `weight` F8_E4M3 + scalar `weight_scale` F32.
    Fp8Tensor,
    /// compressed-tensors `float-quantized` per output channel (llm-compressor's
    /// FP8_DYNAMIC): `weight` F8_E4M3 + `weight_scale` F32 `[out, 1]`.
    Fp8ChannelCompressedTensors,
    /// NVIDIA ModelOpt NVFP4: `weight` U8 + `weight_scale` F8_E4M3 + `weight_scale_2`
    /// F32 (multiplier) [+ `input_scale` F32], quant_algo `W4A16_NVFP4` or `NVFP4`.
    Nvfp4ModelOpt,
    /// compressed-tensors `nvfp4-pack-quantized` (llm-compressor's NVFP4):
    /// `weight_packed` U8 + `weight_scale` F8_E4M3 + `weight_global_scale` F32
    /// (divisor) [+ `input_global_scale` F32 (divisor)].
    Nvfp4CompressedTensors,
    /// Dequantized weights written back as BF16: runs anywhere.
    Bf16Emulated,
}

impl Layout {
    /// Every layout.
    pub const ALL: [Layout; 6] = [
        Self::Fp8Block128,
        Self::Fp8Tensor,
        Self::Fp8ChannelCompressedTensors,
        Self::Nvfp4ModelOpt,
        Self::Nvfp4CompressedTensors,
        Self::Bf16Emulated,
    ];

    /// Command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp8Block128 => "fp8-block128",
            Self::Fp8Tensor => "fp8-tensor",
            Self::Fp8ChannelCompressedTensors => "fp8-channel-ct",
            Self::Nvfp4ModelOpt => "nvfp4-modelopt",
            Self::Nvfp4CompressedTensors => "nvfp4-ct",
            Self::Bf16Emulated => "bf16-emulated",
        }
    }

    /// The native layout of a scheme; schemes without one are written emulated.
    pub fn default_for(scheme: Scheme) -> Layout {
        match scheme {
            Scheme::Fp8Block128 => Self::Fp8Block128,
            Scheme::Fp8Tensor => Self::Fp8Tensor,
            Scheme::Fp8Channel => Self::Fp8ChannelCompressedTensors,
            Scheme::Nvfp4 => Self::Nvfp4ModelOpt,
            _ => Self::Bf16Emulated,
        }
    }

    /// Whether `scheme` can be written in this layout.
    pub fn accepts(self, scheme: Scheme) -> bool {
        self == Self::Bf16Emulated
            || self == Self::default_for(scheme)
            || (self == Self::Nvfp4CompressedTensors && scheme == Scheme::Nvfp4)
    }

    /// Whether this layout stores NVFP4 codes (and so can carry static activation
    /// scales from a calibration file).
    pub fn is_nvfp4(self) -> bool {
        matches!(self, Self::Nvfp4ModelOpt | Self::Nvfp4CompressedTensors)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Layout {
    type Err = QuantError;

    fn from_str(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|layout| layout.name() == name)
            .ok_or_else(|| QuantError::UnknownLayout {
                name: name.to_string(),
                known: Self::ALL.map(Layout::name).join(", "),
            })
    }
}

/// Tensors kept in high precision by default, as published FP8 Qwen3.5 checkpoints
/// keep them: embeddings, lm_head, norms, the linear-attention conv1d / A_log /
/// dt_bias / in_proj_a / in_proj_b, and MoE routers; and the multi-token-prediction
/// head (`mtp.*`) for every scheme, as NVIDIA ModelOpt's exports keep it (its
/// `mtp*` exclusion) and vLLM's Qwen3.5 MTP builds `mtp.fc` unquantized for
/// NVFP4, so a quantized one cannot be loaded for speculative decoding
/// (docs/quantization.md has the evidence).
pub const DEFAULT_SKIP: &[&str] = &[
    r"^mtp\.",
    r"embed_tokens\.",
    r"(^|\.)lm_head\.",
    r"norm\.weight$",
    r"linear_attn\.conv1d\.",
    r"linear_attn\.A_log$",
    r"linear_attn\.dt_bias$",
    r"linear_attn\.in_proj_a\.",
    r"linear_attn\.in_proj_b\.",
    r"mlp\.gate\.weight$",
    r"shared_expert_gate\.",
];

/// Compiles skip patterns, naming the one that fails.
pub fn compile_skip(patterns: &[String]) -> Result<Vec<Regex>> {
    patterns
        .iter()
        .map(|p| {
            Regex::new(p).map_err(|e| QuantError::BadPattern {
                pattern: p.clone(),
                reason: e.to_string(),
            })
        })
        .collect()
}

/// What `write_quantized` does.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// The scheme.
    pub scheme: Scheme,
    /// The layout (must accept the scheme).
    pub layout: Layout,
    /// Tensors whose names match any of these stay as they are.
    pub skip: Vec<Regex>,
    /// Shard size limit of the output.
    pub max_shard_bytes: usize,
}

/// Per-module input absolute maxima from a calibration file (`loraq run
/// --collect-stats`), which NVFP4 layouts turn into static activation scales.
#[derive(Clone, Debug, PartialEq)]
pub struct InputActivationStats {
    /// The calibration file, for error messages.
    pub source: PathBuf,
    /// Module path (no `.weight`) -> largest `|x|` at the module's input.
    pub abs_max: BTreeMap<String, f32>,
}

/// ModelOpt's static NVFP4 activation scale (`input_scale`, dequantization
/// direction): $a / (6 \cdot 448)$ in f32 for the input's largest magnitude $a$, as
/// `NVFP4QTensor.get_activation_scaling_factor`
/// computes it.
pub fn nvfp4_input_scale(amax: f32) -> f32 {
    amax / NVFP4_GLOBAL_DENOMINATOR
}

/// compressed-tensors' global scale (a divisor), `(6 * 448) / amax` in f32, as
/// `generate_gparam` computes it (1 where `amax` is 0, its fallback for a
/// non-finite quotient).
pub fn nvfp4_global_divisor(amax: f32) -> f32 {
    let divisor = NVFP4_GLOBAL_DENOMINATOR / amax;
    if divisor.is_finite() { divisor } else { 1.0 }
}

/// What happens to one input tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TensorAction {
    /// Copied unchanged.
    Copy,
    /// Quantized (a 2-D float `.weight` not skipped).
    Quantize {
        /// Output features.
        out_features: usize,
        /// Input features.
        in_features: usize,
    },
}

/// The output tensors and the action for every input tensor, computed before
/// anything is written so every refusal comes first.
#[derive(Clone, Debug)]
pub struct QuantizePlan {
    /// Input tensor names in order, with what happens to each.
    pub actions: Vec<(String, TensorAction)>,
    /// Output tensors, in write order.
    pub specs: Vec<TensorSpec>,
    /// Module paths left unquantized (2-D `.weight` tensors skipped).
    pub not_converted: Vec<String>,
    /// The `quantization_config` to add to config.json (none for bf16-emulated).
    pub quantization_config: Option<Value>,
    /// Module path -> input absolute maximum of every quantized module, when
    /// calibrated (NVFP4 W4A4); empty for weight-only checkpoints.
    pub input_abs_max: BTreeMap<String, f32>,
}

impl QuantizePlan {
    /// Number of tensors quantized.
    pub fn quantized_count(&self) -> usize {
        self.actions
            .iter()
            .filter(|(_, a)| matches!(a, TensorAction::Quantize { .. }))
            .count()
    }
}

fn is_quantizable(info: &TensorInfo) -> bool {
    info.name.ends_with(".weight")
        && info.shape.len() == 2
        && matches!(
            info.dtype,
            DType::BF16 | DType::F16 | DType::F32 | DType::F64
        )
}

/// Plans the quantization of `input`: which tensors are quantized, the output
/// tensors, and the config. Refuses an input that is already quantized, a scheme
/// the layout cannot hold, and (naming the tensor) a weight whose input dimension
/// the scheme cannot take. NVFP4 is planned weight-only (W4A16).
pub fn plan_quantization(input: &Checkpoint, options: &QuantizeOptions) -> Result<QuantizePlan> {
    plan_quantization_calibrated(input, options, None)
}

/// [`plan_quantization`] with static activation scales: with `calibration`, an
/// NVFP4 layout gets every quantized module's input scale from its input absolute
/// maximum and the W4A4 config. Refuses (naming the file and module) a calibration
/// for a layout that is not NVFP4, a quantized module the file has no absolute
/// maximum for, and one whose maximum is zero or not finite.
pub fn plan_quantization_calibrated(
    input: &Checkpoint,
    options: &QuantizeOptions,
    activation_stats: Option<&InputActivationStats>,
) -> Result<QuantizePlan> {
    let scheme = options.scheme;
    if !options.layout.accepts(scheme) {
        return Err(QuantError::SchemeLayoutMismatch {
            scheme: scheme.name(),
            layout: options.layout.name(),
        });
    }
    if let Some(stats) = activation_stats
        && !options.layout.is_nvfp4()
    {
        return Err(QuantError::ActivationStats {
            path: stats.source.clone(),
            module: "(all)".to_string(),
            reason: format!(
                "static activation scales are written for nvfp4 layouts only, not {}",
                options.layout.name()
            ),
        });
    }
    if let Some(q) = input.config().and_then(|c| c.quantization.as_ref()) {
        return Err(QuantError::UnsupportedConfig {
            path: input.root().to_path_buf(),
            reason: format!("the input is already quantized ({})", q.scheme_name()),
        });
    }
    let mut actions = Vec::new();
    let mut specs = Vec::new();
    let mut not_converted = Vec::new();
    let mut input_abs_max = BTreeMap::new();
    for info in input.tensors() {
        let skipped = options.skip.iter().any(|re| re.is_match(&info.name));
        if !is_quantizable(info) || skipped {
            if skipped && info.name.ends_with(".weight") && info.shape.len() == 2 {
                not_converted.push(info.name.trim_end_matches(".weight").to_string());
            }
            actions.push((info.name.clone(), TensorAction::Copy));
            specs.push(TensorSpec::new(&info.name, info.dtype, info.shape.clone()));
            continue;
        }
        let (out_features, in_features) = (info.shape[0], info.shape[1]);
        let multiple = scheme.input_multiple();
        if in_features % multiple != 0 {
            return Err(QuantError::InputDimNotDivisible {
                tensor: info.name.clone(),
                scheme: scheme.name(),
                multiple,
                in_features,
            });
        }
        let module = info.name.trim_end_matches(".weight");
        if let Some(stats) = activation_stats {
            let amax =
                stats
                    .abs_max
                    .get(module)
                    .copied()
                    .ok_or_else(|| QuantError::ActivationStats {
                        path: stats.source.clone(),
                        module: module.to_string(),
                        reason: "no input absolute maximum (collect the statistics with \
                             `loraq run --collect-stats` on this model)"
                            .to_string(),
                    })?;
            if !(amax.is_finite() && amax > 0.0) {
                return Err(QuantError::ActivationStats {
                    path: stats.source.clone(),
                    module: module.to_string(),
                    reason: format!(
                        "input absolute maximum {amax} gives no static activation scale"
                    ),
                });
            }
            input_abs_max.insert(module.to_string(), amax);
        }
        let calibrated = activation_stats.is_some();
        match options.layout {
            Layout::Bf16Emulated => {
                specs.push(TensorSpec::new(
                    &info.name,
                    DType::BF16,
                    vec![out_features, in_features],
                ));
            }
            Layout::Fp8Block128 | Layout::Fp8Tensor | Layout::Fp8ChannelCompressedTensors => {
                // The codes under the weight's own name, one F32 scale tensor beside them.
                let (scale_name, scale_shape) = match options.layout {
                    Layout::Fp8Block128 => (
                        "weight_scale_inv",
                        vec![
                            blocks(out_features, FP8_BLOCK),
                            blocks(in_features, FP8_BLOCK),
                        ],
                    ),
                    Layout::Fp8Tensor => ("weight_scale", vec![]),
                    Layout::Fp8ChannelCompressedTensors => ("weight_scale", vec![out_features, 1]),
                    _ => unreachable!("an FP8 layout"),
                };
                specs.push(TensorSpec::new(
                    &info.name,
                    DType::F8E4M3,
                    vec![out_features, in_features],
                ));
                specs.push(TensorSpec::new(
                    format!("{module}.{scale_name}"),
                    DType::F32,
                    scale_shape,
                ));
            }
            Layout::Nvfp4ModelOpt | Layout::Nvfp4CompressedTensors => {
                // The same tensors under each serialization's names; its scalars are
                // `[]` (ModelOpt) or `[1]` (compressed-tensors).
                let (packed, global, input, scalar) = if options.layout == Layout::Nvfp4ModelOpt {
                    (info.name.clone(), "weight_scale_2", "input_scale", vec![])
                } else {
                    (
                        format!("{module}.weight_packed"),
                        "weight_global_scale",
                        "input_global_scale",
                        vec![1],
                    )
                };
                specs.push(TensorSpec::new(
                    packed,
                    DType::U8,
                    vec![out_features, in_features / 2],
                ));
                specs.push(TensorSpec::new(
                    format!("{module}.weight_scale"),
                    DType::F8E4M3,
                    vec![out_features, in_features / NVFP4_BLOCK],
                ));
                specs.push(TensorSpec::new(
                    format!("{module}.{global}"),
                    DType::F32,
                    scalar.clone(),
                ));
                if calibrated {
                    specs.push(TensorSpec::new(
                        format!("{module}.{input}"),
                        DType::F32,
                        scalar,
                    ));
                }
            }
        }
        actions.push((
            info.name.clone(),
            TensorAction::Quantize {
                out_features,
                in_features,
            },
        ));
    }
    let calibrated = activation_stats.is_some();
    let quantization_config = match options.layout {
        Layout::Bf16Emulated => None,
        Layout::Fp8Block128 => Some(json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
            "modules_to_not_convert": not_converted,
        })),
        Layout::Fp8Tensor => Some(json!({
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "modules_to_not_convert": not_converted,
        })),
        Layout::Fp8ChannelCompressedTensors => Some(json!({
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8, "type": "float", "symmetric": true,
                        "strategy": "channel", "dynamic": false, "group_size": null,
                        "block_structure": null, "observer": "minmax"
                    },
                    "input_activations": {
                        "num_bits": 8, "type": "float", "symmetric": true,
                        "strategy": "token", "dynamic": true, "observer": null
                    },
                    "output_activations": null
                }
            },
            "ignore": not_converted,
            "kv_cache_scheme": null,
        })),
        Layout::Nvfp4ModelOpt => Some(modelopt_nvfp4_config(&not_converted, calibrated)),
        Layout::Nvfp4CompressedTensors => {
            Some(compressed_tensors_nvfp4_config(&not_converted, calibrated))
        }
    };
    Ok(QuantizePlan {
        actions,
        specs,
        not_converted,
        quantization_config,
        input_abs_max,
    })
}

/// ModelOpt's name for the NVFP4 algorithm: `NVFP4` (W4A4, static activation
/// scales) or `W4A16_NVFP4` (weight-only), the two quant_algo values vLLM's
/// `ModelOptNvFp4Config` accepts.
pub fn modelopt_nvfp4_algo(calibrated: bool) -> &'static str {
    if calibrated { "NVFP4" } else { "W4A16_NVFP4" }
}

/// The producer entry of ModelOpt-style configs: loraq, not ModelOpt, wrote it.
fn producer() -> Value {
    json!({"name": "loraq", "version": env!("CARGO_PKG_VERSION")})
}

/// config.json `quantization_config` of a ModelOpt NVFP4 checkpoint, as ModelOpt's
/// `convert_hf_quant_config_format` writes it (the fields vLLM's
/// `ModelOptQuantConfigBase.from_config` reads when there is no `quantization`
/// key: `quant_algo`, `ignore`, `group_size`, `kv_cache_scheme`).
fn modelopt_nvfp4_config(not_converted: &[String], calibrated: bool) -> Value {
    let nvfp4 =
        json!({"dynamic": false, "num_bits": 4, "type": "float", "group_size": NVFP4_BLOCK});
    let mut group = json!({"weights": nvfp4.clone(), "targets": ["Linear"]});
    if calibrated {
        group["input_activations"] = nvfp4;
    }
    json!({
        "config_groups": {"group_0": group},
        "ignore": not_converted,
        "quant_algo": modelopt_nvfp4_algo(calibrated),
        "producer": producer(),
        "quant_method": "modelopt",
    })
}

/// hf_quant_config.json of a ModelOpt NVFP4 checkpoint (`get_quant_config`'s
/// layout; vLLM requires `group_size`, `kv_cache_quant_algo` and `exclude_modules`
/// in it).
fn modelopt_hf_quant_config(not_converted: &[String], calibrated: bool) -> Value {
    json!({
        "producer": producer(),
        "quantization": {
            "quant_algo": modelopt_nvfp4_algo(calibrated),
            "kv_cache_quant_algo": null,
            "group_size": NVFP4_BLOCK,
            "exclude_modules": not_converted,
        }
    })
}

/// The compressed-tensors format name of packed NVFP4.
pub const COMPRESSED_TENSORS_NVFP4_FORMAT: &str = "nvfp4-pack-quantized";

/// config.json `quantization_config` of a compressed-tensors NVFP4 checkpoint:
/// compressed-tensors' `NVFP4A16` preset (weight-only) or `NVFP4` preset (with
/// `input_activations`, dynamic "local" block scales under the static
/// `input_global_scale`), as llm-compressor saves them.
fn compressed_tensors_nvfp4_config(not_converted: &[String], calibrated: bool) -> Value {
    let nvfp4 = |dynamic: Value| {
        json!({
            "num_bits": 4, "type": "float", "symmetric": true, "group_size": NVFP4_BLOCK,
            "strategy": "tensor_group", "dynamic": dynamic, "actorder": null,
            "block_structure": null, "observer": "minmax", "observer_kwargs": {}
        })
    };
    let input_activations = if calibrated {
        nvfp4(json!("local"))
    } else {
        Value::Null
    };
    json!({
        "quant_method": "compressed-tensors",
        "format": COMPRESSED_TENSORS_NVFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": nvfp4(json!(false)),
                "input_activations": input_activations,
                "output_activations": null,
                "format": COMPRESSED_TENSORS_NVFP4_FORMAT,
            }
        },
        "ignore": not_converted,
        "kv_cache_scheme": null,
        "global_compression_ratio": null,
        "sparsity_config": {},
    })
}

/// Output tensors quantized ahead of the writer: one being written, this many
/// waiting, one being quantized.
const WRITE_QUEUE: usize = 2;

/// A tensor's bytes on their way to the writer thread.
enum TensorBytes<'a> {
    /// Copied from the input's mapping as they are.
    Input(&'a [u8]),
    /// Computed.
    Owned(Vec<u8>),
}

/// Writes the planned checkpoint into `dir` (an empty directory, normally an
/// [`loraq_io::AtomicDir`]'s path): the tensors, sharded past `options.max_shard_bytes`
/// with an index, then config.json with `quantization_config` (and, for NVFP4,
/// ModelOpt's `hf_quant_config.json`). `progress` is called after every input tensor
/// with its name.
///
/// A writer thread writes each tensor while the next is quantized (on every core),
/// with at most a few tensors' output in memory. BF16 weights are quantized straight
/// from the input's bytes (FP8 and NVFP4 convert run by run, never the whole matrix
/// to f32). Errors come in tensor order: a write that failed is reported before a
/// later tensor's refusal.
pub fn write_quantized(
    input: &Checkpoint,
    plan: &QuantizePlan,
    options: &QuantizeOptions,
    dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<()> {
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    // Direct I/O: the output (gigabytes) goes to the disk from one reused buffer
    // instead of into newly allocated page cache; the input stays cached.
    let mut writer = CheckpointWriter::new_with(
        dir,
        plan.specs.clone(),
        options.max_shard_bytes,
        metadata,
        WriteCaching::Direct,
    )?;
    std::thread::scope(|scope| -> Result<()> {
        let (sender, receiver) =
            std::sync::mpsc::sync_channel::<(String, TensorBytes<'_>)>(WRITE_QUEUE);
        let written = scope.spawn(move || -> Result<CheckpointWriter> {
            for (name, bytes) in receiver {
                let bytes = match &bytes {
                    TensorBytes::Input(bytes) => bytes,
                    TensorBytes::Owned(bytes) => bytes.as_slice(),
                };
                writer.write_tensor(&name, bytes)?;
            }
            Ok(writer)
        });
        // False once the writer stopped (its error is reported below).
        let mut send = |name, bytes| sender.send((name, bytes)).is_ok();
        let mut produced = Ok(());
        for (name, action) in &plan.actions {
            match quantize_tensor(input, plan, options, name, action, &mut send) {
                Ok(true) => progress(name),
                Ok(false) => break,
                Err(error) => {
                    produced = Err(error);
                    break;
                }
            }
        }
        drop(sender);
        let writer = written.join().expect("the writer thread does not panic")?;
        produced?;
        writer.finish()?;
        Ok(())
    })?;
    write_configs(input, plan, dir)
}

/// Quantizes (or copies) one input tensor and hands its output tensors to `send`;
/// false when `send` found the writer stopped.
fn quantize_tensor<'a>(
    input: &'a Checkpoint,
    plan: &QuantizePlan,
    options: &QuantizeOptions,
    name: &str,
    action: &TensorAction,
    send: &mut dyn FnMut(String, TensorBytes<'a>) -> bool,
) -> Result<bool> {
    let (out_features, in_features) = match action {
        TensorAction::Copy => {
            return Ok(send(
                name.to_string(),
                TensorBytes::Input(input.bytes(name)?),
            ));
        }
        TensorAction::Quantize {
            out_features,
            in_features,
        } => (*out_features, *in_features),
    };
    let module = name.trim_end_matches(".weight");
    let owned = |bytes: Vec<u8>| TensorBytes::Owned(bytes);
    let bf16 = input.info(name)?.dtype == DType::BF16;
    let (quantized, weight_amax) = if bf16 && options.layout != Layout::Bf16Emulated {
        let bytes = input.bytes(name)?;
        let view = Bf16WeightView::new(name, out_features, in_features, bytes)?;
        // compressed-tensors' divisor is computed from the amax itself, as
        // generate_gparam does, not from the rounded multiplier.
        let quantized = if options.layout == Layout::Nvfp4CompressedTensors {
            view.finite_abs_max()
        } else {
            Ok(0.0)
        }
        .and_then(|amax| Ok((options.scheme.quantize_bf16(view)?, amax)));
        match quantized {
            // The scheme found a NaN or an infinity (in the pass it makes anyway, not
            // one of its own before): refused by file and tensor.
            // (Should the scheme ever report one the input does not hold, its own
            // error goes out rather than a panic.)
            Err(error @ QuantError::NonFinite { .. }) => {
                return Err(match view.first_non_finite() {
                    Some((index, value)) => input.non_finite_error(name, index, value).into(),
                    None => error,
                });
            }
            other => other?,
        }
    } else {
        // Refused by file and tensor before the scheme sees a NaN.
        let values = input.read_f32_finite(name)?;
        let view = WeightView::new(name, out_features, in_features, &values)?;
        if options.layout == Layout::Bf16Emulated {
            let dequantized = options.scheme.fake_quant(view)?;
            drop(values);
            return Ok(send(
                name.to_string(),
                owned(loraq_io::convert::f32_to_bf16_bytes(&dequantized)),
            ));
        }
        let weight_amax = if options.layout == Layout::Nvfp4CompressedTensors {
            view.finite_abs_max()?
        } else {
            0.0
        };
        (options.scheme.quantize(view)?, weight_amax)
    };
    let mut sent = true;
    let mut emit = |name: String, bytes: Vec<u8>| sent = sent && send(name, owned(bytes));
    match quantized {
        QuantizedWeight::Fp8(w) => {
            let scale_name = if options.layout == Layout::Fp8Block128 {
                format!("{module}.weight_scale_inv")
            } else {
                format!("{module}.weight_scale")
            };
            let scales = le_bytes(&w.scales);
            emit(name.to_string(), w.codes);
            emit(scale_name, scales);
        }
        QuantizedWeight::Nvfp4(w) => {
            let Nvfp4GlobalScale::Multiplier(global) = w.global_scale else {
                unreachable!("quantize_nvfp4 writes a multiplier");
            };
            let input_amax = plan.input_abs_max.get(module).copied();
            if options.layout == Layout::Nvfp4CompressedTensors {
                // The same codes and block scales as the ModelOpt layout (the
                // canonical formula); the global scale is stored as
                // compressed-tensors' divisor 2688 / amax.
                let divisor = nvfp4_global_divisor(weight_amax);
                emit(format!("{module}.weight_packed"), w.packed);
                emit(format!("{module}.weight_scale"), w.block_scales);
                emit(
                    format!("{module}.weight_global_scale"),
                    divisor.to_le_bytes().to_vec(),
                );
                if let Some(amax) = input_amax {
                    emit(
                        format!("{module}.input_global_scale"),
                        nvfp4_global_divisor(amax).to_le_bytes().to_vec(),
                    );
                }
            } else {
                emit(name.to_string(), w.packed);
                emit(format!("{module}.weight_scale"), w.block_scales);
                emit(
                    format!("{module}.weight_scale_2"),
                    global.to_le_bytes().to_vec(),
                );
                if let Some(amax) = input_amax {
                    emit(
                        format!("{module}.input_scale"),
                        nvfp4_input_scale(amax).to_le_bytes().to_vec(),
                    );
                }
            }
        }
        QuantizedWeight::Bf16(_)
        | QuantizedWeight::Mxfp4(_)
        | QuantizedWeight::Int4(_)
        | QuantizedWeight::Ggml(_) => {
            unreachable!("plan_quantization only allows native layouts")
        }
    }
    Ok(sent)
}

fn le_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn write_json(path: PathBuf, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialize") + "\n";
    std::fs::write(&path, text).map_err(|source| QuantError::File { path, source })
}

/// config.json with `quantization_config` at the root (where vLLM and transformers
/// look), copied otherwise unchanged; ModelOpt's `hf_quant_config.json` for NVFP4.
fn write_configs(input: &Checkpoint, plan: &QuantizePlan, dir: &Path) -> Result<()> {
    let Some(config) = input.config() else {
        return Ok(());
    };
    let mut raw = config.raw.clone();
    if let (Some(q), Some(object)) = (&plan.quantization_config, raw.as_object_mut()) {
        object.insert("quantization_config".to_string(), q.clone());
    }
    write_json(dir.join(loraq_io::CONFIG_FILE), &raw)?;
    if let Some(q) = &plan.quantization_config
        && q["quant_method"] == "modelopt"
    {
        let hf_quant =
            modelopt_hf_quant_config(&plan.not_converted, !plan.input_abs_max.is_empty());
        write_json(dir.join("hf_quant_config.json"), &hf_quant)?;
    }
    Ok(())
}
